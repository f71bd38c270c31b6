#!/usr/bin/env bash
# End-to-end checks of the command-line tools.
#   tools_e2e.sh BIN_DIR        conversions between every pair of formats, the replay's table and JSON, what
#                               fits, clear errors (exit code 2) on bad input, --help of every tool
#   tools_e2e.sh BIN_DIR plots  the --plot PNGs; exits 77 (CTest: skipped) where gnuplot is not installed
# Every tool's exit status is checked: a tool's output is read from a file after its status, never through a
# pipe or <( ) that would hide it, and a tool killed by a signal fails whatever exit code was wanted.
set -uo pipefail
bin="$1"
section="${2:-tools}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failures=0
checks=0

run() {  # run COMMAND...: stdout to $work/out, stderr to $work/err, the exit status in $rc
  "$@" >"$work/out" 2>"$work/err"
  rc=$?
}
status() {  # how the last run ended, for a failure message
  if [ "$rc" -ge 128 ]; then echo "killed by signal $((rc - 128))"; else echo "exit $rc"; fi
}
pass() { echo "ok: $1"; checks=$((checks + 1)); }
fail() { echo "FAIL: $1"; cat "$work/err"; failures=$((failures + 1)); }

check() {  # check DESCRIPTION COMMAND...: the command exits 0
  local what="$1"; shift
  run "$@"
  if [ "$rc" -eq 0 ]; then pass "$what"; else fail "$what ($(status))"; fi
}
check_output() {  # check_output DESCRIPTION ERE COMMAND...: exits 0 and prints a line matching ERE
  local what="$1" pattern="$2"; shift 2
  run "$@"
  if [ "$rc" -eq 0 ] && grep -qE -- "$pattern" "$work/out"; then pass "$what"
  else fail "$what ($(status), wanted 0 and output matching '$pattern')"; fi
}
check_count() {  # check_count DESCRIPTION ERE N COMMAND...: exits 0 and prints ERE exactly N times
  local what="$1" pattern="$2" want="$3"; shift 3
  run "$@"
  local n
  n=$(grep -oE -- "$pattern" "$work/out" | wc -l)
  if [ "$rc" -eq 0 ] && [ "$n" -eq "$want" ]; then pass "$what"
  else fail "$what ($(status), '$pattern' $n times, wanted exit 0 and $want times)"; fi
}
check_exit() {  # check_exit CODE DESCRIPTION EXPECTED_TEXT COMMAND...: that exit code and the text on stderr
  local code="$1" what="$2" text="$3"; shift 3
  run "$@"
  if [ "$rc" -eq "$code" ] && grep -qF -- "$text" "$work/err"; then pass "$what"
  else fail "$what ($(status), wanted $code and '$text')"; fi
}
check_error() {  # check_error DESCRIPTION EXPECTED_TEXT COMMAND...: exit code 2 and the text on stderr
  local what="$1" text="$2"; shift 2
  check_exit 2 "$what" "$text" "$@"
}
check_png() {  # check_png DESCRIPTION FILE: the file starts with PNG's signature
  local sig
  sig=$(head -c 8 "$2" 2>/dev/null | od -An -tx1 | tr -d ' \n')
  if [ "$sig" = 89504e470d0a1a0a ]; then pass "$1"; else echo "FAIL: $1 (signature '$sig')"; failures=$((failures + 1)); fi
}
finish() {
  [ "$failures" -eq 0 ] || { echo "$failures of $((checks + failures)) check(s) failed"; exit 1; }
  echo "all $checks checks passed"
  exit 0
}

# 128 MiB and 64 MiB live, the 128 MiB freed, 96 MiB allocated: classic splits the cached 128 MiB
# segment, so it reserves 192 MiB for a peak of 192 MiB live.
cat >"$work/oracle.csv" <<'CSV'
Thread,Time,Action,Pointer,Size,Stream
1,00:00:00.000001,allocate,0x10000000,134217728,0
1,00:00:00.000002,allocate,0x20000000,67108864,0
1,00:00:00.000003,free,0x10000000,134217728,0
1,00:00:00.000004,allocate,0x30000000,100663296,0
CSV
small="workload:transformer-infer:layers=4,steps=3"

if [ "$section" = plots ]; then
  command -v gnuplot >/dev/null || { echo "SKIPPED: gnuplot is not installed, --plot was not checked"; exit 77; }
  check "--plot writes a PNG" "$bin/fragless-replay" --plot "$work/p.png" "workload:transformer-infer:steps=2,layers=2"
  check_png "the plot is a PNG" "$work/p.png"
  check "--fit --plot draws at the fitted capacity" "$bin/fragless-replay" --fit --plot "$work/fit.png" "$small"
  check_png "the fit plot is a PNG" "$work/fit.png"
  check "--plot-x event" "$bin/fragless-replay" --plot "$work/ev.png" --plot-x event "$work/oracle.csv"
  check_png "the event-axis plot is a PNG" "$work/ev.png"
  # A trace of one event: one point a curve, which gnuplot's autoscale would call an empty x (and y) range.
  printf 'Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0x1000,100,0\n' >"$work/one.csv"
  check "--plot of a one-event trace" "$bin/fragless-replay" --policy expandable --plot "$work/one.png" "$work/one.csv"
  check_png "... is a PNG" "$work/one.png"
  if grep -qi "warning" "$work/err"; then fail "... but gnuplot warned"; else pass "... with no warning from gnuplot"; fi
  finish
fi
[ "$section" = tools ] || { echo "usage: tools_e2e.sh BIN_DIR [plots]"; exit 2; }

check "convert RMM CSV to native" "$bin/fragless-trace" convert "$work/oracle.csv" "$work/o.fgt"
check "convert native to snapshot" "$bin/fragless-trace" convert "$work/o.fgt" "$work/o.pickle"
check "convert snapshot to RMM CSV" "$bin/fragless-trace" convert "$work/o.pickle" "$work/back.csv"
cut -d, -f3- "$work/oracle.csv" | tail -n +2 >"$work/rows.want"
cut -d, -f3- "$work/back.csv" | tail -n +2 >"$work/rows.got"
check "round trip keeps every row" diff "$work/rows.want" "$work/rows.got"
check_output "info names the format" "format native" "$bin/fragless-trace" info "$work/o.fgt"
check_output "summary --json has the peak" '"peak_live_bytes":201326592' "$bin/fragless-trace" summary --json "$work/o.pickle"
check_count "summary --json --points 1: one point, the peak's" '"live_bytes":201326592' 1 \
  "$bin/fragless-trace" summary --json --points 1 "$work/o.pickle"
check_count "... and at most N points" '"event":' 2 "$bin/fragless-trace" summary --json --points 2 "$work/o.pickle"
check_error "summary --points without --json is refused (the text has no curve)" "add --json" \
  "$bin/fragless-trace" summary --points 5 "$work/o.pickle"
check_error "summary --points in hex is refused" "'0x10' is not a number of points" \
  "$bin/fragless-trace" summary --json --points 0x10 "$work/o.pickle"
check_error "convert --device past what a trace holds" "'4096' is not a device index (an integer from 0 to 4095)" \
  "$bin/fragless-trace" convert --device 4096 "$work/o.pickle" "$work/d.csv"
check_error "a missing argument is said as the tool's other errors are" "fragless-trace: summary needs a trace file" \
  "$bin/fragless-trace" summary
check_error "... and a missing command" "fragless-trace: no command given: info, convert or summary" "$bin/fragless-trace"
check_output "classic reserves 192 MiB on the RMM log" '"policy":"classic".*"peak_reserved_bytes":201326592' \
  "$bin/fragless-replay" --policy classic --json "$work/oracle.csv"
check_output "the same from the converted snapshot" '"peak_reserved_bytes":201326592' \
  "$bin/fragless-replay" --policy classic --json "$work/o.pickle"
# python3 is a build dependency (tools/install_deps.sh): missing, this fails.
check "Python's unpickler reads our snapshot in PyTorch's layout" python3 "$(dirname "$0")/../python/check_snapshot.py" "$work/o.pickle"
# --conf reaches the policy: with lend_pages:False a same-stream re-backing synchronises first (and by
# default it does not).
check_output "by default fragless forces no sync on this workload" '"forced_syncs":0[,}]' \
  "$bin/fragless-replay" --policy fragless --json "workload:transformer-infer"
check_output "--conf changes a fragless setting" '"forced_syncs":[1-9][0-9]*' \
  "$bin/fragless-replay" --policy fragless --json --conf lend_pages:False "workload:transformer-infer"
printf 'length\n100\n2000\n700\n' >"$work/lens.csv"
check "--seqlen-file drives the workload" "$bin/fragless-replay" --seqlen-file "$work/lens.csv" "workload:transformer-train:steps=2,layers=2"
# A header without a recognised column is an error naming what it has and what is accepted (no guess at the
# first integer column); a length out of range names the range.
printf 'len\n100\n2000\n700\n' >"$work/len.csv"
check_error "--seqlen-file without a recognised column names the columns" "the header has 'len'; accepted: one of the columns seqlen, length" \
  "$bin/fragless-replay" --seqlen-file "$work/len.csv" "workload:transformer-train:steps=2,layers=2"
printf 'seqlen\n100\n20000000\n' >"$work/long.csv"
check_error "--seqlen-file: a length out of range states the range" "long.csv:3: '20000000' in column seqlen is not a sequence length (an integer in [1, 10000000])" \
  "$bin/fragless-replay" --seqlen-file "$work/long.csv" "workload:transformer-train:steps=2,layers=2"
check_error "--seqlen-file that no input uses is an error" "--seqlen-file: no input draws its lengths from it" \
  "$bin/fragless-replay" --seqlen-file "$work/lens.csv" "workload:moe" "workload:transformer-train:seqlen=fixed:64"
# No sequence is longer than max_seq: fixed:N past it is an error, a file's longer lengths are cut to it and
# counted in a note (they were cut unseen before).
check_error "seqlen=fixed:N longer than max_seq is an error naming both" "fixed:4096 is longer than max_seq=2048" \
  "$bin/fragless-replay" --policy classic "workload:transformer-train:steps=1,layers=2,seqlen=fixed:4096"
check_exit 0 "--seqlen-file: lengths longer than max_seq are cut, and a note counts them" \
  "1 of the 3 lengths in $work/lens.csv are longer than max_seq=1024 and are cut to it" \
  "$bin/fragless-replay" --policy classic --seqlen-file "$work/lens.csv" "workload:transformer-train:steps=1,layers=2,max_seq=1024"
check "... and no note where none is longer" \
  "$bin/fragless-replay" --policy classic --seqlen-file "$work/lens.csv" "workload:transformer-train:steps=1,layers=2"
if grep -q "longer than max_seq" "$work/err"; then fail "... but a note was printed"; else pass "... none printed"; fi
printf 'seqlen,length\n100,200\n' >"$work/two.csv"
check_exit 0 "--seqlen-file with two length columns names the one it reads" \
  "lengths are read from seqlen (not length;" \
  "$bin/fragless-replay" --policy classic --seqlen-file "$work/two.csv" "workload:transformer-train:steps=1,layers=2"

# Bad input: exit code 2, the file and the position named.
head -c 100 "$work/o.fgt" >"$work/cut.fgt"
check "a native trace cut mid-record still reads, with a warning" "$bin/fragless-trace" info "$work/cut.fgt"
cp "$work/err" "$work/warning"
check "the warning names the byte" grep -q "partial record at byte 64" "$work/warning"
printf 'garbage' >"$work/g.bin"
check_error "unknown format" "unknown trace format" "$bin/fragless-trace" info "$work/g.bin"
printf 'a,b,c\n1,2,3\n' >"$work/other.csv"
check_error "a CSV that is not an RMM log says what its header needs" \
  "a CSV is read as an RMM log when its header names an Action column" "$bin/fragless-trace" info "$work/other.csv"
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,0,explode,0x1,5,0\n' >"$work/bad.csv"
check_error "unknown CSV action names the line" "bad.csv:2: unknown action 'explode'" "$bin/fragless-replay" "$work/bad.csv"
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,0,free,0x1,5,0\n' >"$work/free.csv"
check_error "free of an unknown address" "that was never allocated" "$bin/fragless-replay" "$work/free.csv"
check_error "missing input file" "cannot open" "$bin/fragless-trace" summary "$work/none.pickle"
check_error "bad output extension" "use --to" "$bin/fragless-trace" convert "$work/o.fgt" "$work/o.xyz"
check_error "unknown policy" "unknown policy 'best'" "$bin/fragless-replay" --policy best "$work/o.fgt"
check_error "bad workload" "unknown workload 'gpt'" "$bin/fragless-replay" workload:gpt
check_error "bad --window" "--window needs FROM:TO" "$bin/fragless-replay" --window 0.5 "$work/o.fgt"
check_error "--window with an exponent says what it takes" "written as digits with at most one point" \
  "$bin/fragless-replay" --window 1e-1:1 "$work/o.fgt"
check_error "--window with --max-batch" "not with --max-batch" \
  "$bin/fragless-replay" --window 0:0.5 --max-batch --capacity-gib 8 "workload:transformer-infer"
check_output "--window replays a part, named" "oracle.csv@0.5:1" "$bin/fragless-replay" --window 0.5:1 "$work/oracle.csv"
check_output "results_tables.py general: the targets on windows of a trace and on random draws" "^\| draws \| 10 \| " \
  env FRAGLESS_REPLAY="$bin/fragless-replay" python3 "$(dirname "$0")/../../tools/results_tables.py" general --draws 1 \
  "$work/oracle.csv"
# A small pickle that would build gigabytes (one empty list per byte) is refused with the budget named, not
# an uncaught std::bad_alloc; so is an input that is none of the formats, from its first bytes, even one that
# never ends (a FIFO fed forever).
python3 -c "import sys; open(sys.argv[1], 'wb').write(b'\x80\x02' + b']' * 30000000 + b'.')" "$work/lists.pickle"
check_error "a pickle of 30 million empty lists: the budget, not bad_alloc" "the objects built would take more than" \
  "$bin/fragless-trace" info "$work/lists.pickle"
check_error "... to the replay too" "not a memory snapshot" "$bin/fragless-replay" "$work/lists.pickle"
python3 -c "import sys; open(sys.argv[1], 'wb').write(b'\x80\x02' + b'}' * 12000000 + b'.')" "$work/dicts.pickle"
check_error "... and of empty dicts" "the objects built would take more than" "$bin/fragless-trace" info "$work/dicts.pickle"
rm -f "$work/lists.pickle" "$work/dicts.pickle"
mkfifo "$work/endless"
(yes 0 >"$work/endless" 2>/dev/null &)
check_error "an endless stream of no format is refused from its first bytes" "its first bytes are none of them" \
  timeout 20 "$bin/fragless-trace" info "$work/endless"
# Outputs (Note [Writing an output file]): through a symbolic link to its target, which is replaced; a FIFO is
# refused, never replaced by a regular file; the same for --plot.
echo old >"$work/target.txt"
ln -s target.txt "$work/link.fgt"
check "convert through a symbolic link" "$bin/fragless-trace" convert "$work/oracle.csv" "$work/link.fgt"
check "... the link is still a link" test -L "$work/link.fgt"
check_output "... and its target holds the trace" "format native" "$bin/fragless-trace" info "$work/target.txt"
ln -s missing/deeper.fgt "$work/dangling.fgt"
check_error "a link to a missing folder names the target" "the folder $work/missing of its target $work/missing/deeper.fgt does not exist" \
  "$bin/fragless-trace" convert "$work/oracle.csv" "$work/dangling.fgt"
check_error "convert into a missing folder says so before reading its input" \
  "x.fgt: the folder $work/none does not exist" "$bin/fragless-trace" convert "$work/oracle.csv" "$work/none/x.fgt"
check_error "convert under a file names it" "x.fgt: cannot write (Not a directory)" \
  "$bin/fragless-trace" convert "$work/oracle.csv" "$work/target.txt/x.fgt"
mkfifo "$work/out.fifo"
check_error "a FIFO as the output is refused" "out.fifo: is a FIFO; outputs are written to regular files only" \
  "$bin/fragless-trace" convert --to native "$work/oracle.csv" "$work/out.fifo"
check "... and stays a FIFO" test -p "$work/out.fifo"
ln -s out.fifo "$work/fifo-link.fgt"
check_error "a link to a FIFO is refused, naming both" "fifo-link.fgt: is a FIFO (through the link, $work/out.fifo)" \
  "$bin/fragless-trace" convert "$work/oracle.csv" "$work/fifo-link.fgt"
check_error "--plot to a FIFO is refused before replaying" "--plot $work/out.fifo: is a FIFO" \
  "$bin/fragless-replay" --plot "$work/out.fifo" "$work/oracle.csv"
ln -s out.fifo "$work/fifo-link.gp"
check_error "--plot FILE.gp through a link to a FIFO too" "is a FIFO (through the link" \
  "$bin/fragless-replay" --plot "$work/fifo-link.gp" "$work/oracle.csv"
ln -s plot-target.gp "$work/plot-link.gp"
check "--plot FILE.gp through a symbolic link writes its target" "$bin/fragless-replay" --plot "$work/plot-link.gp" "$work/oracle.csv"
check "... which is a link still, to the script" sh -c 'test -L "$0" && grep -q "set multiplot" "$1"' \
  "$work/plot-link.gp" "$work/plot-target.gp"
# Note [An output never replaces an input]: not by its own name, nor through a link, read-only or not.
cp "$work/oracle.csv" "$work/self.csv"
chmod 444 "$work/self.csv"
check_error "convert onto its own input is refused" "self.csv: is the input $work/self.csv; writing it would replace" \
  "$bin/fragless-trace" convert "$work/self.csv" "$work/self.csv"
ln -s self.csv "$work/self-link.fgt"
check_error "... and through a link to it" "self-link.fgt: is the input $work/self.csv (through a link)" \
  "$bin/fragless-trace" convert "$work/self.csv" "$work/self-link.fgt"
cp "$work/self.csv" "$work/self.gp"
check_error "--plot onto a trace it replays is refused" "--plot $work/self.gp: is the input $work/self.gp" \
  "$bin/fragless-replay" --plot "$work/self.gp" "$work/self.gp"
ln -s self.csv "$work/self-link.gp"
check_error "... and through a link to it" "is the input $work/self.csv (through a link)" \
  "$bin/fragless-replay" --plot "$work/self-link.gp" "$work/self.csv"
check "... every input still as it was" cmp -s "$work/oracle.csv" "$work/self.csv"
check "... and the copy too" cmp -s "$work/oracle.csv" "$work/self.gp"
# What a tool prints on stdout and could not write is an error (exit 2), not a cut answer with status 0:
# a file size limit (SIGXFSZ ignored, so the write fails with EFBIG), and a closed stdout.
limited() { (trap '' XFSZ; ulimit -f 1; "$@" >"$work/limited.out"); }
check_error "fragless-replay --json past a file size limit" "cannot write the output to stdout" \
  limited "$bin/fragless-replay" --json "$small" "$work/oracle.csv"
check_error "fragless-trace info past it" "cannot write the output to stdout" \
  limited "$bin/fragless-trace" info $(for _ in $(seq 20); do echo "$work/o.fgt"; done)
check_error "fragless-config --table past it" "cannot write the output to stdout" limited "$bin/fragless-config" --table
check_error "fragless-trace info to a closed stdout" "cannot write the output to stdout" \
  sh -c '"$0" info "$1" >&-' "$bin/fragless-trace" "$work/o.fgt"
check_error "fragless-replay's table to a closed stdout" "cannot write the output to stdout" \
  sh -c '"$0" "$1" >&-' "$bin/fragless-replay" "$work/oracle.csv"
# A converted file reads back: a native trace whose sizes the other formats refuse is refused when read.
python3 - "$work/o.fgt" "$work/huge.fgt" <<'PY'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
b[64 + 16:64 + 24] = (2**64 - 1).to_bytes(8, "little")  # the first record's requested size
open(sys.argv[2], "wb").write(b)
PY
check_error "a native trace with an alloc of 2^64-1 bytes is refused when read" \
  "huge.fgt: record 0 at byte 64: size 18446744073709551615 is outside [0, 2^63)" "$bin/fragless-trace" info "$work/huge.fgt"
check_error "... by convert too, writing nothing" "size 18446744073709551615 is outside" \
  "$bin/fragless-trace" convert "$work/huge.fgt" "$work/huge.pickle"
check "... nothing written" test ! -e "$work/huge.pickle"
# Devices sharing a native file interleave it in chunks: the time span runs from the earliest record, not the
# first in the file (device 1's pair, 60 ms in, was written before device 0's, 1 ms in).
python3 - "$work/shared.fgt" <<'PY'
import struct, sys
head = b"FRAGLESS" + struct.pack("<HHHHIiiIQ16sQ", 1, 64, 48, 0, 1, -1, -1, 0, 0, b"fragless", 0)
def rec(t_ms, addr, action, dev, seq):  # action 1 alloc, 13 free (TraceAction)
    return struct.pack("<QQQQQHBBI", int(t_ms * 1e6), addr, 4096, 4096, 0, dev, action, 0xA5, seq)
body = rec(60, 0x1000, 1, 1, 0) + rec(61, 0x1000, 13, 1, 1) + rec(1, 0x1000, 1, 0, 0) + rec(2, 0x1000, 13, 0, 1)
open(sys.argv[1], "wb").write(head + body)
PY
check_output "fragless-trace info: a shared file's time span is from its earliest record" "time span 0.060000 s" \
  "$bin/fragless-trace" info "$work/shared.fgt"
# A snapshot kept with torch.save (a zip archive holding data.pkl, or the legacy format that begins with a
# pickle of its magic number) is named as such, with what to write instead.
python3 - "$work/saved.pt" "$work/saved_legacy.pt" <<'PY'
import pickle, sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w") as z:
    z.writestr("saved/data.pkl", pickle.dumps({"segments": [], "device_traces": [[]]}, protocol=2))
with open(sys.argv[2], "wb") as f:
    for v in (0x1950a86a20f9469cfc6c, 1001, {"protocol_version": 1001}):
        pickle.dump(v, f, protocol=2)
PY
check_error "a torch.save zip archive is named as one" "saved.pt: a file torch.save wrote (a zip archive), not a snapshot pickle" \
  "$bin/fragless-trace" info "$work/saved.pt"
check_error "... and its legacy format" "saved_legacy.pt: a file torch.save wrote (its legacy format)" \
  "$bin/fragless-replay" "$work/saved_legacy.pt"
# A device with memory and no history (history off on it, or on every device) is summarised, not left out;
# convert writes the first device with events to an RMM log by default, not the first with blocks.
python3 - "$work/nohist.pickle" "$work/dev1.pickle" <<'PY'
import pickle, sys
M = 1 << 20
def seg(dev, addr):
    return {"device": dev, "address": addr, "total_size": 2 * M, "allocated_size": M, "active_size": M,
            "requested_size": M, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": [],
            "blocks": [{"address": addr, "size": M, "requested_size": M, "state": "active_allocated", "frames": []},
                       {"address": addr + M, "size": M, "requested_size": 0, "state": "inactive", "frames": []}]}
a, b = 0x7f0000000000, 0x7e0000000000
pickle.dump({"segments": [seg(0, a)], "device_traces": [[]]}, open(sys.argv[1], "wb"))
events = [{"action": "alloc", "addr": b + M, "size": 4096, "stream": 0, "time_us": 10},
          {"action": "free_completed", "addr": b + M, "size": 4096, "stream": 0, "time_us": 20}]
pickle.dump({"segments": [seg(0, a), seg(1, b)], "device_traces": [[], events]}, open(sys.argv[2], "wb"))
PY
check_output "summary: a device with memory and no history is shown" "device 0: 0 events" \
  "$bin/fragless-trace" summary "$work/nohist.pickle"
# A replayed input with nothing to replay: its reader's warning and that it is skipped, in one line.
check_exit 2 "a snapshot without history is skipped" "nothing to replay" "$bin/fragless-replay" "$work/nohist.pickle"
cp "$work/err" "$work/nohist.err"
check "... said in one line with why" sh -c 'test "$(grep -c "warning: .*nohist.pickle" "$1")" = 1 &&
  grep -q "only the 1 block live at the dump is known.*; no allocation events to replay .*: skipped" "$1"' sh "$work/nohist.err"
check "convert to an RMM log: the first device with events by default" \
  "$bin/fragless-trace" convert "$work/dev1.pickle" "$work/dev1.csv"
cp "$work/err" "$work/dev1.err"
check "... which is named" grep -q "writing device 1 (--device)" "$work/dev1.err"
check "... and the block live before its events is said written as an allocation, counted" \
  grep -q "the 1 allocation live before .*dev1.pickle's first event is written to .*dev1.csv as allocations at that event's time" "$work/dev1.err"
# An RMM log's failed allocations are counted (oom events), and written back as such.
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.5,allocate,0x10,5,0\n1,00:00:01.5,allocate failure,(nil),99,0\n' >"$work/failure.csv"
check_output "RMM: allocate failure rows are counted as oom events" "oom 1 " "$bin/fragless-trace" info "$work/failure.csv"
check_output "... and a time of .5 is half a second" "time span 1.000000 s" "$bin/fragless-trace" info "$work/failure.csv"
check "... converted to native" "$bin/fragless-trace" convert "$work/failure.csv" "$work/failure.fgt"
check "... and back to an RMM log" "$bin/fragless-trace" convert "$work/failure.fgt" "$work/failure2.csv"
check "... which keeps the failure row" grep -q ",allocate failure,0x0,99," "$work/failure2.csv"
# A failed request of any 64-bit size (an underflow's) is a record, not memory: every format keeps it.
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.5,allocate,0x10,5,0\n1,00:00:01.5,allocate failure,0x0,18446744073709551615,0\n' \
  >"$work/absurd.csv"
check_output "RMM: a failed allocation of 2^64 - 1 bytes is read" "oom 1 " "$bin/fragless-trace" info "$work/absurd.csv"
check "... converted to native" "$bin/fragless-trace" convert "$work/absurd.csv" "$work/absurd.fgt"
check "... to a snapshot" "$bin/fragless-trace" convert "$work/absurd.fgt" "$work/absurd.pickle"
check "... and back to an RMM log" "$bin/fragless-trace" convert "$work/absurd.pickle" "$work/absurd2.csv"
check "... which keeps its size" grep -q ",allocate failure,0x0,18446744073709551615," "$work/absurd2.csv"
# A temporary file a crashed run left beside the output does not stop the next write.
# (exec keeps the shell's pid: the name a per-pid temporary would have had is taken.)
check "a leftover temporary file beside the output" sh -c ': >"$2.tmp$$"; : >"$2.tmpXXXXXX"; exec "$1" convert "$3" "$2"' \
  sh "$bin/fragless-trace" "$work/absurd3.csv" "$work/absurd.csv"
check "... and the output written" test -s "$work/absurd3.csv"
# --costs: an unknown call name and a median no probe measures are refused.
printf '{"schema":"fragless-gpu-probe/1","costs_us":{"cuMemCreat":{"2097152":{"median":10}}}}' >"$work/typo.json"
check_error "--costs: an unknown call is named" "costs_us: unknown call 'cuMemCreat'" \
  "$bin/fragless-replay" --costs "$work/typo.json" "$work/oracle.csv"
printf '{"schema":"fragless-gpu-probe/1","costs_us":{"cuMemCreate":{"2097152":{"median":1e308}}}}' >"$work/huge.json"
check_error "--costs: an absurd median is refused" "cuMemCreate at 2097152 bytes: median 1e+308" \
  "$bin/fragless-replay" --costs "$work/huge.json" "$work/oracle.csv"
# Options: each is given once; a capacity below a byte, an empty --plot, an empty policy name are errors;
# integer workload keys take integers only.
check_error "--capacity-gib given twice" "--capacity-gib is given twice: give it once" \
  "$bin/fragless-replay" --capacity-gib 1 --capacity-gib 100 "$work/oracle.csv"
check_error "--policy given twice" "--policy is given twice" "$bin/fragless-replay" --policy classic --policy fragless "$work/oracle.csv"
check_error "--capacity-gib that rounds to 0 bytes" "--capacity-gib 1e-10: less than one byte" \
  "$bin/fragless-replay" --capacity-gib 1e-10 "$work/oracle.csv"
check_error "--plot ''" "--plot needs a file name" "$bin/fragless-replay" --plot '' "$work/oracle.csv"
check_error "--policy classic, (an empty name)" "--policy 'classic,': an empty policy name between commas" \
  "$bin/fragless-replay" --policy classic, "$work/oracle.csv"
for kv in layers=1.5 layers=0x10 "layers= 5" layers=+5; do
  check_error "transformer key $kv is not an integer" "bad value" "$bin/fragless-replay" "workload:transformer-train:$kv"
done
for kv in layers=1.5 layers=0x10 "layers= 5" seed=1.5; do
  check_error "zoo key $kv is not an integer" "is not an integer in [" "$bin/fragless-replay" "workload:moe:$kv"
done
check_error "a zoo real key in hexadecimal" "is not a number in [" "$bin/fragless-replay" "workload:moe:skew=0x1"
check_error "transformer seed=1.5" "workload option seed: bad value '1.5'" "$bin/fragless-replay" "workload:transformer-train:seed=1.5"
# results_tables.py: a bad command or value is argparse's error (exit 2), and it runs from any directory.
check_error "results_tables.py: an unknown command" "invalid choice: 'bogus'" python3 "$(dirname "$(realpath "$0")")/../../tools/results_tables.py" bogus
check_error "results_tables.py general --seed abc" "argument --seed: invalid int value: 'abc'" \
  python3 "$(dirname "$(realpath "$0")")/../../tools/results_tables.py" general --seed abc
check_exit 1 "results_tables.py: a replay's error comes first, then the command that met it" \
  "fragless-replay: $work/g.bin: unknown trace format" \
  env FRAGLESS_REPLAY="$bin/fragless-replay" python3 "$(dirname "$(realpath "$0")")/../../tools/results_tables.py" replay "$work/g.bin"
if head -1 "$work/err" | grep -q "^fragless-replay: "; then pass "... on its first line"; else fail "... not on its first line"; fi
# results_tables.py check: a table a quoted command prints must stand in the docs line for line.
rt="$(dirname "$(realpath "$0")")/../../tools/results_tables.py"
check "results_tables.py zoo (the table the checks below quote)" env FRAGLESS_REPLAY="$bin/fragless-replay" python3 "$rt" zoo
cp "$work/out" "$work/zoo.md"
check_doc() {  # check_doc DESCRIPTION CODE TEXT DOC_BODY: check's exit code and a line of its output
  local what="$1" code="$2" text="$3"
  printf '%s\n' "$4" >"$work/doc.md"
  run env FRAGLESS_REPLAY="$bin/fragless-replay" python3 "$rt" check "$work/doc.md"
  if [ "$rc" -eq "$code" ] && grep -qF -- "$text" "$work/out"; then pass "$what"
  else fail "$what ($(status), wanted $code and '$text'; it printed: $(cat "$work/out"))"; fi
}
check_doc "results_tables.py check: the table its command prints now" 0 "1 run, 0 failed" \
  "$(printf 'The zoo: `python3 tools/results_tables.py zoo`\n\n'; cat "$work/zoo.md")"
check_doc "results_tables.py check: one figure that is not what the command prints now" 1 "now:  | unet2d |" \
  "$(printf 'The zoo: `python3 tools/results_tables.py zoo`\n\n'; sed 's/^| unet2d | [0-9.]* |/| unet2d | 1.0 |/' "$work/zoo.md")"
check_doc "results_tables.py check: a doc table with a row the command no longer prints fails" 1 "prints a table the docs do not hold" \
  "$(printf 'The zoo: `python3 tools/results_tables.py zoo`\n\n'; cat "$work/zoo.md"; echo '| stale-pattern | 1 | 2 | 3 |')"
run env FRAGLESS_REPLAY="$bin/fragless-replay" python3 "$rt" headline "$work/o.fgt"
head -1 "$work/out" >"$work/headline"
check_doc "results_tables.py check: a command that prints no table: the figures of its first line, in the paragraph" 0 \
  "every figure of its first line is in the paragraph quoting it" \
  "$(printf 'Said: %s (`python3 tools/results_tables.py headline %s`).' "$(cat "$work/headline")" "$work/o.fgt")"
check_doc "results_tables.py check: ... a figure the paragraph lacks fails, naming it" 1 \
  "lacks $(sed -E 's/.* a mean ([0-9.]+)% .*/\1/' "$work/headline")" \
  "$(printf 'Said: %s (`python3 tools/results_tables.py headline %s`).' "$(sed -E 's/ a mean [0-9.]+%/ a mean 0.01%/' "$work/headline")" "$work/o.fgt")"
check_doc "results_tables.py check: a quoted command it does not accept" 1 "is not accepted: " \
  'Run `python3 tools/results_tables.py driver --cost x.json` for measured costs (an abbreviation).'
check_doc "results_tables.py check: a command with a placeholder is parsed, not run" 0 "accepted, not run" \
  'Any seed: `python3 tools/results_tables.py general --seed S --draws 6`.'
check_doc "results_tables.py check: a quoted check is parsed, not run (it would run itself)" 0 "it is this check" \
  "$(printf '`python3 tools/results_tables.py check %s`' "$work/doc.md")"
check_doc "results_tables.py check: an input that is not there skips" 77 "SKIPPED: " \
  '`python3 tools/results_tables.py replay no/such/dir/*.pickle`'
check_doc "results_tables.py check: ... a costs file too" 77 "x.json not found" \
  '`python3 tools/results_tables.py driver --costs x.json`'
check_error "--conf expandable_segments:False alone selects nothing: refused" "expandable_segments:False: selects no policy" \
  "$bin/fragless-replay" --conf expandable_segments:False "$work/o.fgt"
check_output "... with the policy it agrees with, it runs" " classic " "$bin/fragless-replay" --conf expandable_segments:False,policy:classic "$work/o.fgt"
check_error "bad --conf value" "bad value '7' for key 'reserve_slack'" "$bin/fragless-replay" --conf reserve_slack:7 "$work/o.fgt"
check_error "a bad --conf names --conf, not the environment variable" "fragless-replay: --conf: unknown key 'polcy'" \
  "$bin/fragless-replay" --conf polcy:x "$work/o.fgt"
check_error "fragless-config --table with something beside it" "fragless-config: --table takes nothing else" \
  "$bin/fragless-config" --table x
check_error "... before it too" "fragless-config: --table takes nothing else" "$bin/fragless-config" policy:classic --table
check_output "fragless-config: --help anywhere is the usage" "^usage: fragless-config" "$bin/fragless-config" policy:x -h
check_error "fragless-config STRING names itself, not the environment variable" "fragless-config: unknown key 'polcy'" \
  "$bin/fragless-config" polcy:x
check_error "... and FRAGLESS_CONF when the string came from there" "FRAGLESS_CONF: unknown key 'polcy'" \
  env FRAGLESS_CONF=polcy:x "$bin/fragless-config"
# A directory or an empty file as a trace is named as such (not "unknown trace format").
: >"$work/empty.fgt"
check_error "an empty trace file is named empty" "empty.fgt: is empty" "$bin/fragless-trace" info "$work/empty.fgt"
check_error "... to the replay too" "empty.fgt: is empty" "$bin/fragless-replay" "$work/empty.fgt"
check_error "a directory as a trace is named a directory" "$work: is a directory" "$bin/fragless-trace" summary "$work"
check_error "... to the replay too" "$work: is a directory" "$bin/fragless-replay" "$work"
# Inputs that hold no allocation at all: each is named, and the run fails rather than print an empty table.
printf 'Thread,Time,Action,Pointer,Size,Stream\n' >"$work/none.csv"
check_error "no input with an allocation: nothing to replay" "nothing to replay" "$bin/fragless-replay" "$work/none.csv"
check_output "... while one that has some still replays" "oracle.csv" "$bin/fragless-replay" "$work/none.csv" "$work/oracle.csv"
# The RMM reader refuses a second allocate of a live address, as the native reader does.
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,5,0\n1,1,allocate,0x20,5,0\n1,2,allocate,0x10,5,0\n' >"$work/twice.csv"
check_error "RMM log: an address allocated twice names file, line and address" \
  "twice.csv:4: address 0x10 allocated again without a free (allocated at line 2)" "$bin/fragless-trace" info "$work/twice.csv"
# fragless-trace: a bad --device and an unknown command are said plainly.
check_error "--device x: a device index, an integer" "'x' is not a device index (an integer from 0 to 4095)" \
  "$bin/fragless-trace" convert --device x "$work/o.fgt" "$work/x.csv"
check_error "an unknown command is named" "unknown command 'frobnicate' (commands: info, convert, summary" \
  "$bin/fragless-trace" frobnicate "$work/o.fgt"
check_error "convert --device N of a device the trace lacks names the ones it has" "has no device 3 (its devices: 0)" \
  "$bin/fragless-trace" convert --device 3 "$work/o.fgt" "$work/x.csv"
check_error "convert --device with a target that holds every device" "--device chooses the device of an RMM log" \
  "$bin/fragless-trace" convert --device 0 "$work/o.fgt" "$work/x.pickle"
# Replay options: the range of --capacity-gib, a --plot into a folder that is not there, gnuplot's exit code.
check_error "--capacity-gib out of range names the range" "greater than 0 and at most 1024 (the replay's largest device), not '1e30'" \
  "$bin/fragless-replay" --capacity-gib 1e30 "$work/o.fgt"
check_error "--capacity-gib in hex is refused, not read as 16" "greater than 0 and at most 1024 (the replay's largest device), not '0x10'" \
  "$bin/fragless-replay" --capacity-gib 0x10 "$work/o.fgt"
check_error "--fit-step of nan is refused" "--fit-step needs a number of GiB" "$bin/fragless-replay" --fit --fit-step nan "$work/o.fgt"
check_error "--plot into a missing folder names the folder" "the folder $work/none/deeper does not exist" \
  "$bin/fragless-replay" --plot "$work/none/deeper/x.png" "$work/o.fgt"
check_error "--plot x.svg is refused (gnuplot would write PNG bytes into it)" "draws a PNG (FILE.png) or writes its gnuplot script (FILE.gp), not a '.svg file'" \
  "$bin/fragless-replay" --plot "$work/x.svg" "$work/o.fgt"
check_error "--plot naming a folder" "is a directory; --plot takes a file name" "$bin/fragless-replay" --plot "$work" "$work/o.fgt"
mkdir -p "$work/fakebin"
printf '#!/bin/sh\ncat >/dev/null\necho "fake gnuplot: cannot draw" >&2\nexit 3\n' >"$work/fakebin/gnuplot"
chmod +x "$work/fakebin/gnuplot"
check_error "a failing gnuplot: its exit code, not the wait status" "--plot: gnuplot exited with code 3 drawing" \
  env PATH="$work/fakebin:$PATH" "$bin/fragless-replay" --plot "$work/x.png" "$work/o.fgt"
cp "$work/err" "$work/gnuplot.err"  # (check's own run truncates $work/err)
check "... and its own message reaches stderr" grep -q "fake gnuplot: cannot draw" "$work/gnuplot.err"
# A key given twice is an error naming it: in a workload spec, a zoo spec, --conf and FRAGLESS_CONF.
check_error "a workload key given twice" "workload option batch is given twice" \
  "$bin/fragless-replay" "workload:transformer-train:batch=2,batch=3"
check_error "a zoo key given twice" "workload moe: key layers is given twice" "$bin/fragless-replay" "workload:moe:layers=2,layers=3"
check_error "a --conf key given twice" "key 'policy' is given more than once" \
  "$bin/fragless-replay" --conf "policy:classic,policy:fragless" "$work/o.fgt"
check_error "a key repeated across --conf options" "--conf handles: the key is given again by a second --conf" \
  "$bin/fragless-replay" --conf handles:pages --conf handles:ends "$work/o.fgt"
check_error "fragless-config: a key given twice" "key 'policy' is given more than once" \
  "$bin/fragless-config" "policy:classic,policy:fragless"
check_error "fragless-config: a second string is not ignored" "one configuration string at a time, got 2" \
  "$bin/fragless-config" policy:classic driver:host
check_error "fragless-config: an empty key is named empty" "an empty key before ':' (value 'fragless')" "$bin/fragless-config" ":fragless"
# fragless-config prints every key, the ones the string set and the defaults of the others.
check "fragless-config shows what it was given" "$bin/fragless-config" "handles:pages,background:False,trace:run-%p.fgt,peer_access:False"
cp "$work/out" "$work/echo"
for line in "handles: pages" "background: False" "trace: run-%p.fgt" "peer_access: False" "policy: fragless (default)" \
            "capacity_mb: the device's memory (default; not used here: it configures the host and sim drivers only (the cuda driver's device has its own))"; do
  check "... the line '$line'" grep -qxF "$line" "$work/echo"
done
"$bin/fragless-config" --table | grep -c '^| `' >"$work/keys"
check "... one line per key of the table" test "$(wc -l <"$work/echo")" -eq "$(cat "$work/keys")"
check_output "fragless-config: the host driver's default capacity" "^capacity_mb: 4096 \(default of the host driver\)$" \
  "$bin/fragless-config" "driver:host"
check_output "fragless-config: the sim driver's default capacity" "^capacity_mb: 81920 \(default of the sim driver\)$" \
  "$bin/fragless-config" "driver:sim"
check_output "fragless-config: -0 is 0" "^per_process_memory_fraction: 0$" "$bin/fragless-config" "per_process_memory_fraction:-0"
# A key the configuration does not use (setting it would be refused) is shown as not in effect, not as a default.
check_output "fragless-config: a fragless key under policy:classic is not used" \
  "^handles: cells \(default; not used here: it configures the fragless policy only\)$" "$bin/fragless-config" "policy:classic"
check_output "fragless-config: garbage_collection_threshold under the fragless policy is not used" \
  "^garbage_collection_threshold: 0 \(off; default; not used here: it configures the classic policy only" \
  "$bin/fragless-config" "driver:host"
check_output "... and a key in use keeps its plain default" "^handles: cells \(default\)$" "$bin/fragless-config" "driver:host"

# What fits: --fit and --max-batch / --max-of, their JSON, and their errors.
check_count "--fit --json gives min_capacity_bytes per policy" '"min_capacity_bytes":[0-9]+' 3 \
  "$bin/fragless-replay" --fit --fit-step 0.0625 --json "$small"
check_count "--fit --json gives replayed_up_to_bytes per policy (every step up to it fits)" '"replayed_up_to_bytes":[0-9]+' 3 \
  "$bin/fragless-replay" --fit --fit-step 0.0625 --json "$small"
check_output "--fit table names the step" "step 0\.25 GiB" "$bin/fragless-replay" --fit "$small"
check_count "--max-batch --json gives max_value and the key" '"key":"batch","max_value":[0-9]+' 3 \
  "$bin/fragless-replay" --max-batch --capacity-gib 4 --json "$small"
check_output "--max-of max_seq" "max_seq" "$bin/fragless-replay" --max-of max_seq --capacity-gib 2 "$small,batch=8"
check_error "--max-of a key that is not numeric" "key 'dtype' is not numeric" \
  "$bin/fragless-replay" --max-of dtype --capacity-gib 8 "$small"
check_error "--max-batch on a trace names both searches" "--max-batch and --max-of search a key of a built-in workload; this input is a trace" \
  "$bin/fragless-replay" --max-batch --capacity-gib 8 "$work/o.fgt"
check_error "... said before a missing capacity, which would not help" "this input is a trace" \
  "$bin/fragless-replay" --max-batch "$work/o.fgt"
check_error "--max-batch needs a capacity" "need the device's size" "$bin/fragless-replay" --max-batch "$small"
check_error "--fit with a capacity" "drop --capacity-gib" "$bin/fragless-replay" --fit --capacity-gib 8 "$small"
check_error "--fit-step without --fit" "--fit-step applies to --fit" "$bin/fragless-replay" --fit-step 1 "$small"
check_error "--peak-detail with --fit" "--peak-detail describes one replay" "$bin/fragless-replay" --fit --peak-detail "$small"
check_error "--plot-x with a bad axis" "expected time, event or auto" "$bin/fragless-replay" --plot-x days "$small"
check_error "--fit-step too fine" "--fit-step needs" "$bin/fragless-replay" --fit --fit-step 0 "$small"
check_error "--jobs names the value it refuses" "--jobs needs a whole number in [1, 1024], not '+2'" \
  "$bin/fragless-replay" --jobs +2 "$small"
printf '\xef\xbb\xbfseqlen\n100\n2000\n' >"$work/bom.csv"
check "--seqlen-file with a byte-order mark (as spreadsheets write)" "$bin/fragless-replay" --seqlen-file "$work/bom.csv" \
  "workload:transformer-train:steps=2,layers=2"
check_exit 1 "a capacity too small for the smallest batch" "does not fit at its smallest batch=1" \
  "$bin/fragless-replay" --max-batch --capacity-gib 0.01 "$small"
# The line under the table says how the answers were checked only of the answers found.
if grep -q "no search found an answer, so none was checked" "$work/out" && ! grep -q "every answer was replayed" "$work/out"
then pass "... and its summary claims no checked answer"; else fail "... and its summary claims no checked answer"; fi
check_output "--max-batch: a summary of the answers found when one search has none" \
  "the one answer found \(of 2 searches\) was replayed with 0 OOMs, one above it with at least 1" \
  sh -c '"$0" --policy fragless --max-batch --capacity-gib 0.5 "$1" "$2"; [ $? -eq 1 ]' "$bin/fragless-replay" \
  "workload:transformer-infer:layers=2,steps=2" "workload:transformer-infer:layers=24,steps=2"
check_error "--max-batch on a workload without batch says so and suggests --max-of" \
  "workload moe has no key 'batch' to search (--max-batch searches batch); --max-of KEY searches one of its keys: layers" \
  "$bin/fragless-replay" --max-batch --capacity-gib 8 "workload:moe"
check_error "--max-batch on a spec that sets batch" "sets batch, the key the search varies" \
  "$bin/fragless-replay" --max-batch --capacity-gib 8 "$small,batch=4"
check_output "--help: random's live_gib is only a cap" "random: .*live_gib is" "$bin/fragless-replay" --help
check_output "... not a target" "only a cap \(an allocation that would pass it is skipped\), not a target" "$bin/fragless-replay" --help
# A workload past 20 million events is refused with the spec named (it crashed with std::bad_alloc before).
check_error "a workload too large to generate" "workload:transformer-train:layers=1000000: more than 20000000 allocation events" \
  "$bin/fragless-replay" --policy classic "workload:transformer-train:layers=1000000"
# random draws every operation, skipped or not: ops=10^7 and steps=10^5 made few events and ran for hours
# before it reached the event cap (the timeout fails the check on that code).
check_error "a random workload of more operations than it may draw is refused at once" \
  "ops x steps = 1000000000000 operations, more than 400000000 (each is drawn, even one the live_gib cap skips)" \
  timeout 60 "$bin/fragless-replay" --policy classic "workload:random:ops=10000000,steps=100000"
check_error "a transformer workload drawing more lengths than it may is refused at once" \
  "batch x steps = 1000000000000 sequence lengths to draw, more than 400000000" \
  timeout 60 "$bin/fragless-replay" --policy classic "workload:transformer-train:batch=1000000,steps=1000000"
# A field's leading spaces were erased one at a time: 6.4 million of them took minutes (now milliseconds).
{ printf 'Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0x1000,'
  head -c 6400000 /dev/zero | tr '\0' ' '; printf '100,0\n'; } >"$work/spaces.csv"
check_output "an RMM field after millions of spaces is read in linear time" "1 events of every kind" \
  timeout 60 "$bin/fragless-trace" info "$work/spaces.csv"
check_exit 1 "a search that cannot converge" "cannot converge" \
  "$bin/fragless-replay" --policy classic --max-of seed --capacity-gib 8 "workload:transformer-infer:layers=2,steps=2"
check_exit 1 "... says it stopped below the seeds a transformer workload takes" \
  "seed=1000000000000000, where the search stops (the workload takes larger values" \
  "$bin/fragless-replay" --policy classic --max-of seed --capacity-gib 8 "workload:transformer-infer:layers=2,steps=2"
check_output "--help: --max-of searches a seed up to 1e15" "a seed: up to 1e15" "$bin/fragless-replay" --help
check_error "--plot-x without --plot" "--plot-x applies to --plot" "$bin/fragless-replay" --plot-x event "$small"
check_output "--max-of: the largest value a workload accepts is an answer when it fits" "live_gib +10000\* " \
  "$bin/fragless-replay" --policy classic --max-of live_gib --capacity-gib 100 "workload:random:ops=50,steps=1"
check_output "... marked as such" "except the 1 marked '\*': the largest value the workload accepts" \
  "$bin/fragless-replay" --policy classic --max-of live_gib --capacity-gib 100 "workload:random:ops=50,steps=1"
# A ratio with an answer at that limit is a bound, not a measured ratio (it printed 566893.42 for min_bytes).
check_output "--max-of: a ratio against an answer at the workload's limit is marked a bound" \
  "fragless +min_bytes +1000000000\* +>[0-9.]+ " \
  "$bin/fragless-replay" --policy classic,fragless --max-of min_bytes --capacity-gib 24 "workload:random:ops=300,steps=2"
check_error "a zoo workload's seed past 1e15" "seed='1000000000000001' is not an integer in [0, 1000000000000000]" \
  "$bin/fragless-replay" --policy classic "workload:random:ops=10,steps=1,seed=1000000000000001"
check_output "--help exits 0 and documents --fit" "--fit" "$bin/fragless-replay" --help
# Every program in the build's bin/ answers --help with its usage on stdout and exit 0 (Google Benchmark's
# programs print their flags).
for tool in "$bin"/*; do
  [ -f "$tool" ] && [ -x "$tool" ] || continue
  check_output "$(basename "$tool") --help exits 0 with its usage" "[Uu]sage|--benchmark_filter" timeout 60 "$tool" --help
done
for tool in fragless-replay fragless-trace fragless-config fragless-oracles fragless-capi-harness \
            fragless-preload-program fragless-tests; do
  [ -x "$bin/$tool" ] || fail "$tool was not built"
done

# Nothing in --conf is ignored: a policy selects it, a key the replay cannot honour is refused.
tiny="workload:transformer-infer:layers=2,steps=2"
check_count "--conf policy:classic replays classic alone" '"policy":"classic"' 1 "$bin/fragless-replay" --json --conf policy:classic "$tiny"
check_count "... and no other policy" '"policy":"(expandable|fragless)"' 0 "$bin/fragless-replay" --json --conf policy:classic "$tiny"
check_count "--conf expandable_segments:True replays expandable alone" '"policy":"[a-z]*"' 1 \
  "$bin/fragless-replay" --json --conf expandable_segments:True "$tiny"
check_output "... and that is expandable" '"policy":"expandable"' "$bin/fragless-replay" --json --conf expandable_segments:True "$tiny"
check_count "--peak-detail: at_peak in each --json result" '"at_peak":\{"event":' 3 "$bin/fragless-replay" --json --peak-detail "$tiny"
check_count "... and not without it" '"at_peak"' 0 "$bin/fragless-replay" --json "$tiny"
check_count "--peak-detail: a line under each row of the table" '^  at its peak \(event [0-9]+\): .* MiB reserved = ' 3 \
  "$bin/fragless-replay" --peak-detail "$tiny"
check_count "--peak-detail: the page floor under each row" '^  page floor [0-9.]+ MiB \(' 3 \
  "$bin/fragless-replay" --peak-detail "$tiny"
check_count "... and page_floor_bytes in each --json result" '"page_floor_bytes":[0-9]+' 3 \
  "$bin/fragless-replay" --json --peak-detail "$tiny"
check_count "... and no percentage over a peak live of nothing (every allocation out of memory)" \
  '^  page floor 0\.0 MiB: the most pages' 3 "$bin/fragless-replay" --peak-detail --capacity-gib 0.0001 "$tiny"
check_error "--conf policy and --policy disagree" "name different policies" \
  "$bin/fragless-replay" --conf policy:classic --policy fragless "$work/o.fgt"
for key in driver:host capacity_mb:64 trace:x.fgt peer_access:False shareable_handles:True on_oom:throw; do
  check_error "--conf ${key%%:*} is refused, not ignored" "not a replay setting" "$bin/fragless-replay" --conf "$key" "$work/o.fgt"
done
check_error "an error names what was typed" "'handles ends' is not key:value" \
  "$bin/fragless-replay" --conf "handles ends" "$work/o.fgt"
check_error "PyTorch's own keys are named as such" "PyTorch's own allocator" \
  "$bin/fragless-replay" --conf "backend:cudaMallocAsync" "$work/o.fgt"
# --help lists every workload key with its default and range; a bad value's error says what it accepts.
for kv in "layers=24 \[1, 1000000\]" "dropout=0 \[0, 1\]" "ckpt=0 \[0, 1\]" "padding=none \(none or longest\)" \
          "seqlen=sharegpt \(" "dtype=fp32 \(fp32 or bf16\)" "seed=1 \(" "levels=4 \[" "max_batch=32 \["; do
  check_output "--help lists $kv" "$kv" "$bin/fragless-replay" --help
done
for key in layers d_model heads d_ff vocab batch steps max_seq ckpt dropout accum seqlen dtype padding seed; do
  check_error "workload key $key: a bad value's error says what it accepts" "expected" \
    "$bin/fragless-replay" "workload:transformer-train:$key=nonsense"
done
check_error "a zoo key's error gives its range" "levels='99' is not an integer in [1, 8]" "$bin/fragless-replay" "workload:unet2d:levels=99"
check_error "a pipeline's rank is one of its stages" "rank=3 is not one of its stages=2 (rank counts stages from 0)" \
  "$bin/fragless-replay" "workload:pipeline:stages=2,rank=3"
check_output "--max-of stages starts at a stage the rank has" "stages +[0-9]+\*? " \
  "$bin/fragless-replay" --policy classic --max-of stages --capacity-gib 80 "workload:pipeline:steps=1,layers=1,rank=2"
check_output "--max-of rank ends at the last stage" "rank +3\* " \
  "$bin/fragless-replay" --policy classic --max-of rank --capacity-gib 80 "workload:pipeline:steps=1,layers=1,stages=4"
check_output "the zoo's help writes a seed's range as the parser takes it" "seed=1 \[0, 1000000000000000\]" \
  "$bin/fragless-replay" --help
check_error "--capacity-gib past the replay's largest device" "at most 1024 (the replay's largest device), not '1025'" \
  "$bin/fragless-replay" --capacity-gib 1025 "$small"
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x1000,2199023255552,0\n1,10:00:00.000002,free,0x1000,2199023255552,0\n' >"$work/2tib.csv"
check_exit 0 "an allocation past the unlimited device is a warning, naming it" "1 allocation failed on 1024 GiB, the largest device the replay models" \
  "$bin/fragless-replay" --policy fragless "$work/2tib.csv"
# The table ends with a legend of its columns; info and the replay say what their event counts count.
check "the replay's table" "$bin/fragless-replay" "$work/o.fgt"
tail -n 1 "$work/out" >"$work/last"  # read before check's run truncates $work/out (a process substitution raced it)
check "... ends with a legend" grep -q "^columns: events = alloc, free and empty_cache" "$work/last"
# The legend says what is computed (docs/ARCHITECTURE.md, "Fragmentation — one set of definitions").
check "... whose overhead is peak reserved over peak live" grep -qF "overhead = peak reserved / peak live - 1;" "$work/last"
check "... and frag@pk one minus peak allocated over peak reserved" \
  grep -qF "frag@pk = 1 - peak allocated / peak reserved (each peak taken on its own" "$work/last"
check_output "info says what its event count counts" "events of every kind \(4 of them allocs, frees and empty_cache calls" \
  "$bin/fragless-trace" info "$work/o.fgt"
# A plot draws what the window began with as already present: a snapshot whose first event frees a block
# allocated before the window (a pre-window allocation of 64 MiB) starts every curve before x = 0 at 64 MiB.
cat >"$work/pre.py" <<'PY'
import pickle, sys
MiB = 1 << 20
trace = [{"action": "free_completed", "addr": 0x7f0000000000, "size": 64 * MiB, "stream": 0, "time_us": 1000},
         {"action": "alloc", "addr": 0x7f0010000000, "size": 8 * MiB, "stream": 0, "time_us": 2000},
         {"action": "free_completed", "addr": 0x7f0010000000, "size": 8 * MiB, "stream": 0, "time_us": 3000},
         {"action": "alloc", "addr": 0x7f0020000000, "size": 16 * MiB, "stream": 0, "time_us": 4000}]
pickle.dump({"segments": [], "device_traces": [trace]}, open(sys.argv[1], "wb"), protocol=4)
PY
check "a snapshot with an allocation from before its window" python3 "$work/pre.py" "$work/pre.pickle"
check "--plot FILE.gp writes the script" "$bin/fragless-replay" --plot "$work/pre.gp" --plot-x event "$work/pre.pickle"
grep -A1 "<< EOD" "$work/pre.gp" >"$work/first-points"
check_count "... whose every curve starts before the window at the pre-window state" "^-[0-9.]+ 64\.000 64\.000 [0-9.]+$" 3 \
  cat "$work/first-points"
check_output "... and marks where the window starts" '"window start"' cat "$work/pre.gp"
# A trace without times (an RMM log without a Time column) converted to an RMM log gets one microsecond per
# event, so the replay's time-weighted fragmentation is the same (it was 0 with every row at 00:00:00).
cut -d, -f1,3- "$work/oracle.csv" >"$work/untimed.csv"
check "a trace without times converts to an RMM log" "$bin/fragless-trace" convert "$work/untimed.csv" "$work/timed.csv"
cp "$work/err" "$work/convert.err"
check "... saying how its times were made" grep -q "one microsecond each" "$work/convert.err"
check "the untimed trace replays" "$bin/fragless-replay" --json --policy classic "$work/untimed.csv"
grep -o '"time_weighted_fragmentation":[0-9.e+-]*' "$work/out" >"$work/twf.want"
check "the converted log replays" "$bin/fragless-replay" --json --policy classic "$work/timed.csv"
grep -o '"time_weighted_fragmentation":[0-9.e+-]*' "$work/out" >"$work/twf.got"
check "... with the same time-weighted fragmentation" diff "$work/twf.want" "$work/twf.got"
check "... which is not 0" grep -qv '"time_weighted_fragmentation":0.000000$' "$work/twf.want"
# empty_cache calls (a burst of segment_free in a snapshot): the native format keeps them; a conversion to a
# format that cannot hold them says how many it leaves out.
cat >"$work/ec.py" <<'PY'
import pickle, sys
MiB, A = 1 << 20, 0x7f0000000000
def e(action, addr, size, t):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t}
trace = [e("segment_alloc", A, 20 * MiB, 1), e("segment_alloc", A + 20 * MiB, 20 * MiB, 2),
         e("alloc", A, 8 * MiB, 3), e("alloc", A + 20 * MiB, 8 * MiB, 4),
         e("free_completed", A, 8 * MiB, 5), e("free_completed", A + 20 * MiB, 8 * MiB, 6),
         e("segment_free", A, 20 * MiB, 7), e("segment_free", A + 20 * MiB, 20 * MiB, 8), e("alloc", A, 8 * MiB, 9)]
pickle.dump({"segments": [], "device_traces": [trace]}, open(sys.argv[1], "wb"), protocol=4)
PY
check "a snapshot whose cache was emptied" python3 "$work/ec.py" "$work/ec.pickle"
check "converted to native" "$bin/fragless-trace" convert "$work/ec.pickle" "$work/ec.fgt"
cp "$work/err" "$work/ec.err"
check_count "... with no note (the native format holds empty_cache)" "not kept" 0 cat "$work/ec.err"
check_output "... which keeps the empty_cache call" "empty_cache 1 " "$bin/fragless-trace" info "$work/ec.fgt"
check "converted to an RMM log" "$bin/fragless-trace" convert "$work/ec.fgt" "$work/ec.csv"
cp "$work/err" "$work/ec.err"
check "... saying the empty_cache call is not kept" \
  grep -qE "not kept in .*ec\.csv: .*1 empty_cache events \(an RMM log has allocate, allocate failure and free rows only\)" "$work/ec.err"
check "converted to a snapshot" "$bin/fragless-trace" convert "$work/ec.fgt" "$work/ec2.pickle"
cp "$work/err" "$work/ec.err"
check "... saying the same" grep -qE "not kept in .*ec2\.pickle: 1 empty_cache events \(a PyTorch snapshot has no such entries\)" \
  "$work/ec.err"

# A cache the allocator held before the window (a segment at the dump that no event made) is what classic's
# replay starts from; the native format keeps it, a snapshot written from it does not, and says so.
cat >"$work/pre.py" <<'PY'
import pickle, sys
MiB, A = 1 << 20, 0x7f0000000000
seg = {"device": 0, "address": A, "total_size": 20 * MiB, "allocated_size": 0, "active_size": 0,
       "requested_size": 0, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
       "is_expandable": False, "frames": [], "blocks": [{"address": A, "size": 20 * MiB, "requested_size": 0,
                                                          "state": "inactive", "frames": []}]}
trace = [{"action": "alloc", "addr": A, "size": 8 * MiB, "stream": 0, "time_us": 1},
         {"action": "free_completed", "addr": A, "size": 8 * MiB, "stream": 0, "time_us": 2}]
pickle.dump({"segments": [seg], "device_traces": [trace]}, open(sys.argv[1], "wb"), protocol=4)
PY
check "a snapshot with a cache from before its window" python3 "$work/pre.py" "$work/pre.pickle"
check "converted to native" "$bin/fragless-trace" convert "$work/pre.pickle" "$work/pre.fgt"
cp "$work/err" "$work/pre.err"
check_count "... with no note (the native format keeps that cache)" "not kept" 0 cat "$work/pre.err"
check "converted back to a snapshot" "$bin/fragless-trace" convert "$work/pre.fgt" "$work/pre2.pickle"
cp "$work/err" "$work/pre.err"
check "... saying that cache is not kept" \
  grep -qE "not kept in .*pre2\.pickle: the 1 segment \(20 MiB\) the allocator held when the window began" "$work/pre.err"
# A snapshot whose entries free a block twice, and one whose times are not times: the same error from every
# tool, at once, naming the entry.
cat >"$work/twice.py" <<'PY'
import pickle, sys
MiB, A = 1 << 20, 0x7f0000000000
e = lambda action, t: {"action": action, "addr": A, "size": 8 * MiB, "stream": 0, "time_us": t}
traces = {"twice": [e("alloc", 1), e("free_requested", 2), e("free_completed", 3), e("free_completed", 4)],
          "negative": [e("alloc", -10), e("free_completed", 3)],
          "huge": [e("alloc", 1), e("free_completed", 2 ** 63 + 5)]}
for name, trace in traces.items():
    pickle.dump({"segments": [], "device_traces": [trace]}, open(sys.argv[1] + name + ".pickle", "wb"), protocol=4)
good = pickle.dumps({"segments": [], "device_traces": [[e("alloc", 1), e("free_completed", 2)]]}, protocol=4)
open(sys.argv[1] + "trailing.pickle", "wb").write(good + good)
assert good[2] == 0x95  # FRAME, then its 8-byte length
open(sys.argv[1] + "frame.pickle", "wb").write(good[:3] + (2 ** 63).to_bytes(8, "little") + good[11:])
PY
check "snapshots with bad entries" python3 "$work/twice.py" "$work/bad-"
for tool in "fragless-trace info" "fragless-trace summary" "fragless-replay"; do
  check_error "$tool: a second free of a block the window freed" \
    "device_traces[0][3] ('free_completed'): a second free of 0x7f0000000000, which device_traces[0][2] freed" \
    $bin/$tool "$work/bad-twice.pickle"
done
check_error "a negative time is refused, naming the entry" "device_traces[0][0] ('alloc'): 'time_us' is -10, outside [0," \
  "$bin/fragless-trace" info "$work/bad-negative.pickle"
check_error "... and one past what a native trace holds" "'time_us' is 9223372036854775813, outside [0, 18446744073709551]" \
  "$bin/fragless-trace" info "$work/bad-huge.pickle"
check_exit 0 "bytes after a snapshot's pickle are named, not passed over" "bytes after the pickle's end (byte" \
  "$bin/fragless-trace" info "$work/bad-trailing.pickle"
check_error "a frame past the end of the file" "a frame of 9223372036854775808 bytes, past the end of the input" \
  "$bin/fragless-trace" info "$work/bad-frame.pickle"
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x1000,1024,0\n1,10:00:00.000002,free,0x1000,2048,0\n' >"$work/size.csv"
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,9000000000000000000,allocate,0x1000,1024,0\n' >"$work/bigtime.csv"
check_error "an RMM time past 2^64 ns" "time 9000000000000000000 µs is past 18446744073709551 (2^64 ns)" \
  "$bin/fragless-trace" info "$work/bigtime.csv"
check_error "an RMM free of another size than its allocation's" \
  "free of address 0x1000 with size 2048, but line 2 allocated it with size 1024" "$bin/fragless-trace" info "$work/size.csv"
finish
