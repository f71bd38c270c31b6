"""Checks that a snapshot written by `fragless-trace convert` is what PyTorch's memory viewer expects:
Python's own unpickler reads it (refusing any class lookup), the layout has PyTorch's keys, every
segment's blocks tile it (the assertion `_memory_viz segsum` makes), and every trace action is one the
viewer knows."""
import pickle
import sys
from checks import check  # noqa: E402


class DataOnly(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"snapshot refers to {module}.{name}")


ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "snapshot", "oom"}


def main(path):
    with open(path, "rb") as f:
        snap = DataOnly(f).load()
    check(isinstance(snap, dict), "top level is not a dict")
    for key in ("segments", "device_traces"):
        check(key in snap, f"missing {key}")
    for seg in snap["segments"]:
        for key in ("device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                    "segment_type", "blocks"):
            check(key in seg, f"segment missing {key}")
        total = sum(b["size"] for b in seg["blocks"])
        check(total == seg["total_size"], f"blocks sum to {total}, segment is {seg['total_size']}")
        addr = seg["address"]
        for b in seg["blocks"]:
            check(b["address"] == addr, "blocks are not contiguous")
            check(b["state"] in ("active_allocated", "active_pending_free", "inactive"))
            addr += b["size"]
    events = 0
    for trace in snap["device_traces"]:
        for e in trace:
            check(e["action"] in ACTIONS, f"unknown action {e['action']}")
            check("addr" in e or "device_free" in e)
            events += 1
    check(events > 0, "no trace entries")
    print(f"{path}: {len(snap['segments'])} segments, {events} trace entries: OK")


if __name__ == "__main__":
    main(sys.argv[1])
