# Sourced by the scripts whose steps can take minutes (sanitize.sh, fuzz.sh, gpu_bundle.sh,
# install_deps.sh): run a step quietly, its output in a log file, with a progress line at least once a
# minute and the end of the log when it fails.
#   quiet_step LABEL LOG COMMAND [ARG...]
# Prints "LABEL: still running (N s): LAST LOG LINE" every 50 s, "LABEL: done (N s)" at the end; on
# failure the last 40 lines of LOG, and the step's exit status is returned.
quiet_step() {
  local label="$1" log="$2"
  shift 2
  local start=$SECONDS rc=0 pid last
  "$@" >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    for _ in $(seq 50); do
      sleep 1
      kill -0 "$pid" 2>/dev/null || break 2
    done
    last="$(tail -n 1 "$log" 2>/dev/null | cut -c1-120)"
    echo "$label: still running ($((SECONDS - start)) s): $last"
  done
  wait "$pid" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "$label: failed (exit $rc) after $((SECONDS - start)) s; the end of $log:"
    tail -n 40 "$log"
    return "$rc"
  fi
  echo "$label: done ($((SECONDS - start)) s)"
}
