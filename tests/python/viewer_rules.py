"""Applies the rules of PyTorch's memory viewer (torch/utils/viz/MemoryViz.js, the page pytorch.org/memory_viz
loads a dropped file into) to snapshots, and reports every place where the viewer would fail or draw wrongly.

  viewer_rules.py [--max-batch N] SNAPSHOT...     exit 0 when every rule holds, 1 with the reasons otherwise

The rules, read from the viewer's source:
- unpickle: only the opcodes its own unpickler knows; APPENDS / SETITEMS spread one batch into a single
  JavaScript call, which overflows the stack at about 10^5 items, so a batch may hold at most 1000 items
  (CPython's own batch size);
- annotate: a block's address is its segment's address plus the sizes of the blocks before it, so the blocks
  must tile the segment in address order; free_requested directly followed by free_completed of the same
  address becomes one 'free';
- Allocator State History (simulate_memory): the state before event i is the state at the end with events
  undone from the last down to i+1. Undoing 'free' / 'free_completed' adds the block, 'free_requested' clears
  the pending mark of a block that must exist, 'alloc' removes it, 'segment_free' inserts a segment,
  'segment_unmap' inserts a range and merges it with a same-stream neighbour that touches it, 'segment_alloc'
  removes the segment that starts at that address (the viewer removes the last segment when none does), and
  'segment_map' removes a range that must lie inside one segment (the viewer throws "Cannot read properties of
  undefined (reading 'addr')" otherwise). Every block drawn must lie inside a segment (the viewer throws when
  none holds its address and draws it outside the outline when it runs past the end). This checker makes one
  backward pass and checks each state, so every event of the trace is stepped through;
- time_us, where events have it, never goes backwards.
"""
import bisect
import struct
import sys

KNOWN = set(b"e h J K M } ] \x95 \x8a j ( \x94 \x80 u \x8c . \x86 a \x89 q X ) \x88 N G t \x85 \x87 r l d s".split())
KNOWN = {op[0] for op in KNOWN}


class Rules(Exception):
    pass


def unpickle(data, max_batch, problems):
    """The viewer's unpickler, on Python values; records batches larger than max_batch."""
    stack, marks, memo = [], [], {}
    off = 0
    biggest = 0

    def u4():
        nonlocal off
        v = struct.unpack_from("<I", data, off)[0]
        off += 4
        return v

    while True:
        if off >= len(data):
            raise Rules("the pickle ends without STOP")
        op = data[off]
        off += 1
        if op not in KNOWN:
            raise Rules(f"opcode 0x{op:02x} at byte {off - 1} is not one the viewer's unpickler knows")
        c = chr(op)
        if op == 0x80:
            v = data[off]
            off += 1
            if v < 2 or v > 4:
                raise Rules(f"protocol {v}: the viewer reads 2 to 4")
        elif c == "a":
            v = stack.pop()
            stack[-1].append(v)
        elif c == "e":
            m = marks.pop()
            items = stack[m:]
            del stack[m:]
            biggest = max(biggest, len(items))
            stack[m - 1].extend(items)
        elif c in "lt":
            m = marks.pop()
            items = stack[m:]
            del stack[m:]
            stack.append(list(items))
        elif op == 0x89:
            stack.append(False)
        elif op == 0x88:
            stack.append(True)
        elif c == "N":
            stack.append(None)
        elif c == "h":
            stack.append(memo[data[off]])
            off += 1
        elif c == "J":
            stack.append(struct.unpack_from("<i", data, off)[0])
            off += 4
        elif c == "K":
            stack.append(data[off])
            off += 1
        elif c == "M":
            stack.append(struct.unpack_from("<H", data, off)[0])
            off += 2
        elif c == "}":
            stack.append({})
        elif c == "]":
            stack.append([])
        elif op == 0x95:
            off += 8
        elif op == 0x8A:
            n = data[off]
            off += 1
            stack.append(int.from_bytes(data[off:off + n], "little", signed=True))
            off += n
        elif c == "j":
            stack.append(memo[u4()])
        elif c == "(":
            marks.append(len(stack))
        elif op == 0x94:
            memo[len(memo)] = stack[-1]
        elif c == "q":
            memo[data[off]] = stack[-1]
            off += 1
        elif c == "r":
            memo[u4()] = stack[-1]
        elif c in "ud":
            m = marks.pop()
            items = stack[m:]
            del stack[m:]
            biggest = max(biggest, len(items) // 2)
            d = stack[m - 1] if c == "u" else {}
            for i in range(0, len(items), 2):
                d[items[i]] = items[i + 1]
            if c == "d":
                stack.append(d)
        elif c == "s":
            v = stack.pop()
            k = stack.pop()
            stack[-1][k] = v
        elif op == 0x8C:
            n = data[off]
            off += 1
            stack.append(data[off:off + n].decode())
            off += n
        elif c == "X":
            n = u4()
            stack.append(data[off:off + n].decode())
            off += n
        elif c == ".":
            if biggest > max_batch:
                problems.append(f"a list or dict batch holds {biggest} items (at most {max_batch}: the viewer "
                                "spreads a batch into one call)")
            return stack.pop()
        elif c == ")":
            stack.append([])
        elif op == 0x85:
            stack.append([stack.pop()])
        elif op == 0x86:
            t = stack[-2:]
            del stack[-2:]
            stack.append(t)
        elif op == 0x87:
            t = stack[-3:]
            del stack[-3:]
            stack.append(t)
        elif c == "G":
            stack.append(struct.unpack_from(">d", data, off)[0])
            off += 8


def annotate(snap, problems):
    """annotate_snapshot: elided frees, block addresses from the tiling."""
    traces = []
    for dev, trace in enumerate(snap.get("device_traces", [])):
        out = []
        last_time = None
        for i, t in enumerate(trace):
            t = dict(t)
            if "time_us" in t and t["time_us"] is not None:
                if last_time is not None and t["time_us"] < last_time:
                    problems.append(f"device {dev} event {i}: time_us {t['time_us']} is before {last_time}")
                last_time = t["time_us"]
            if t["action"] == "free_completed" and out and out[-1]["action"] == "free_requested" and \
                    out[-1].get("addr") == t.get("addr"):
                out[-1]["action"] = "free"
                continue
            out.append(t)
        traces.append(out)
    snap["device_traces"] = traces
    for seg in snap.get("segments", []):
        addr = seg["address"]
        for b in seg["blocks"]:
            if "address" in b and b["address"] != addr:
                problems.append(f"segment 0x{seg['address']:x}: a block listed at 0x{b['address']:x} is drawn at "
                                f"0x{addr:x} (the blocks do not tile the segment)")
            b["addr"] = addr
            addr += b["size"]
        if addr != seg["address"] + seg["total_size"]:
            problems.append(f"segment 0x{seg['address']:x}: blocks cover {addr - seg['address']} bytes of "
                            f"{seg['total_size']}")


class State:
    """The viewer's l_segments (kept sorted, non-overlapping) and l_block_map, with the checks."""

    def __init__(self, snap, device, problems):
        self.p = problems
        self.segs = []  # [addr, size, stream] sorted by addr
        self.blocks = {}  # addr -> [size, free_requested]
        self.baddrs = []  # sorted block addresses
        for seg in snap.get("segments", []):
            if seg.get("device", 0) != device:
                continue
            self.add_segment(seg["address"], seg["total_size"], seg.get("stream", 0), merge=False, where="at dump")
            for b in seg["blocks"]:
                if b["state"] in ("active_allocated", "active_pending_free"):
                    self.add_block(b["addr"], b["size"], b["state"] == "active_pending_free", "at dump")

    def find(self, addr):
        i = bisect.bisect_right([s[0] for s in self.segs], addr) - 1
        if i >= 0 and self.segs[i][0] <= addr < self.segs[i][0] + self.segs[i][1]:
            return i
        return -1

    def add_block(self, addr, size, pending, where):
        if addr not in self.blocks:
            bisect.insort(self.baddrs, addr)
        self.blocks[addr] = [size, pending]
        i = self.find(addr)
        if i < 0:
            self.p.append(f"{where}: block 0x{addr:x} lies in no segment (the viewer throws)")
        elif addr + size > self.segs[i][0] + self.segs[i][1]:
            self.p.append(f"{where}: block 0x{addr:x}+{size} runs past the end of segment 0x{self.segs[i][0]:x} "
                          "(drawn outside its outline)")

    def remove_block(self, addr):
        if addr in self.blocks:
            del self.blocks[addr]
            self.baddrs.pop(bisect.bisect_left(self.baddrs, addr))

    def add_segment(self, addr, size, stream, merge, where):
        starts = [s[0] for s in self.segs]
        i = bisect.bisect_left(starts, addr)
        if (i > 0 and self.segs[i - 1][0] + self.segs[i - 1][1] > addr) or \
                (i < len(self.segs) and addr + size > self.segs[i][0]):
            self.p.append(f"{where}: segment 0x{addr:x}+{size} overlaps one already there")
            return
        self.segs.insert(i, [addr, size, stream])
        if merge:
            if i + 1 < len(self.segs) and addr + size == self.segs[i + 1][0] and stream == self.segs[i + 1][2]:
                self.segs[i][1] += self.segs[i + 1][1]
                del self.segs[i + 1]
            if i > 0 and self.segs[i - 1][0] + self.segs[i - 1][1] == addr and self.segs[i - 1][2] == stream:
                self.segs[i - 1][1] += self.segs[i][1]
                del self.segs[i]

    def remove_range(self, addr, size, merge, where):
        if not merge:
            idx = [k for k, s in enumerate(self.segs) if s[0] == addr]
            if not idx:
                self.p.append(f"{where}: segment_alloc 0x{addr:x} has no segment starting there (the viewer "
                              "removes the last segment instead)")
                return
            k = idx[0]
            addr, size = self.segs[k][0], self.segs[k][1]
            del self.segs[k]
        else:
            k = self.find(addr)
            if k < 0 or addr + size > self.segs[k][0] + self.segs[k][1]:
                self.p.append(f"{where}: segment_map 0x{addr:x}+{size} lies inside no segment (the viewer throws "
                              "'Cannot read properties of undefined')")
                return
            s = self.segs[k]
            end, s_end = addr + size, s[0] + s[1]
            if s[0] == addr:
                s[0] += size
                s[1] -= size
                if s[1] == 0:
                    del self.segs[k]
            elif s_end == end:
                s[1] -= size
            else:
                s[1] = addr - s[0]
                self.segs.insert(k + 1, [end, s_end - end, s[2]])
        j = bisect.bisect_left(self.baddrs, addr)
        if j > 0 and self.baddrs[j - 1] + self.blocks[self.baddrs[j - 1]][0] > addr:
            j -= 1
        if j < len(self.baddrs) and self.baddrs[j] < addr + size:
            self.p.append(f"{where}: the range 0x{addr:x}+{size} leaves the viewer while block "
                          f"0x{self.baddrs[j]:x} in it is still drawn")


def check_device(snap, device, problems):
    st = State(snap, device, problems)
    events = snap["device_traces"][device] if device < len(snap["device_traces"]) else []
    limit = len(problems) + 20  # a broken snapshot breaks at many events; the first few say why
    for i in range(len(events) - 1, 0, -1):
        e = events[i]
        a = e["action"]
        where = f"device {device}, stepping back over event {i} ({a})"
        if a == "free":
            st.add_block(e["addr"], e["size"], False, where)
        elif a == "free_completed":
            st.add_block(e["addr"], e["size"], True, where)
        elif a == "free_requested":
            if e["addr"] not in st.blocks:
                problems.append(f"{where}: free_requested of 0x{e['addr']:x}, which the viewer holds no block for "
                                "(it throws)")
            else:
                st.blocks[e["addr"]][1] = False
        elif a == "alloc":
            st.remove_block(e["addr"])
        elif a in ("segment_free", "segment_unmap"):
            st.add_segment(e["addr"], e["size"], e.get("stream", 0), a == "segment_unmap", where)
        elif a in ("segment_alloc", "segment_map"):
            st.remove_range(e["addr"], e["size"], a == "segment_map", where)
        if len(problems) >= limit:
            problems.append(f"device {device}: stopped after 20 problems")
            return


def check(path, max_batch=1000):
    problems = []
    with open(path, "rb") as f:
        data = f.read()
    try:
        snap = unpickle(data, max_batch, problems)
    except (Rules, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        return [f"the viewer cannot unpickle it: {e}"]
    if not isinstance(snap, dict) or "segments" not in snap or "device_traces" not in snap:
        return ["not a snapshot: no segments / device_traces"]
    annotate(snap, problems)
    devices = set(range(len(snap["device_traces"]))) | {s.get("device", 0) for s in snap["segments"]}
    for d in sorted(devices):
        check_device(snap, d, problems)
    return problems


def main(argv):
    max_batch = 1000
    if len(argv) > 1 and argv[0] == "--max-batch":
        max_batch = int(argv[1])
        argv = argv[2:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    bad = 0
    for path in argv:
        problems = check(path, max_batch)
        if problems:
            bad += 1
            print(f"{path}: {len(problems)} problem(s)")
            for p in problems[:25]:
                print("  " + p)
        else:
            print(f"{path}: the viewer's rules hold")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
