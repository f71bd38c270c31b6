#!/usr/bin/env bash
# The Python package from outside the tree, offline, as the README says: a virtual environment of PYTHON
# that sees its system packages (Debian's torch, setuptools and wheel), `pip install --no-build-isolation
# SOURCE` with no package index, then from a temporary folder check_installed.py (the installed library,
# preload library and OOM thrower are used, with no compiler and no sys.path edit), `pip uninstall` (nothing
# left behind); then `pip wheel`, and the wheel installed into a second fresh environment and checked again.
#   pip_install.sh PYTHON SOURCE_DIR BUILD_DIR [CPU_PROBE]
# BUILD_DIR keeps setup.py's CMake tree between runs (FRAGLESS_PIP_BUILD_DIR); CPU_PROBE makes
# libfragless.so PyTorch's CPU allocator so the OOM goes through PyTorch's bindings (tests/python/oom_probe.cpp).
set -euo pipefail
py="$1"
src="$2"
build="$3"
probe="${4:-}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! "$py" -c "import venv, setuptools, wheel" 2>/dev/null; then
  echo "SKIPPED: $py lacks venv, setuptools or wheel (Debian: apt-get install python3-venv python3-setuptools python3-wheel)"
  exit 77
fi
echo "interpreter: $py ($("$py" --version 2>&1))"
# Offline and with no configuration of this machine's: no index, no find-links.
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 FRAGLESS_PIP_BUILD_DIR="$build"
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL FRAGLESS_LIBRARY FRAGLESS_CONF PYTHONPATH || true
# The environments have no pip of their own: the system's pip, seen through --system-site-packages, installs
# into the environment it runs in.
fresh_env() {
  "$py" -m venv --system-site-packages --without-pip "$1"
  "$1/bin/python" -m pip --version >/dev/null || { echo "SKIPPED: no pip for $py (Debian: apt-get install python3-pip)"; exit 77; }
}
check() {  # ENV: run the checks from a folder outside the tree, with no compiler and an empty cache
  mkdir -p "$work/elsewhere" "$work/cache-$2"
  (cd "$work/elsewhere" && env CXX=/bin/false XDG_CACHE_HOME="$work/cache-$2" FRAGLESS_CPU_PROBE="$probe" \
     "$1/bin/python" "$src/tests/packaging/check_installed.py")
  [ -z "$(ls -A "$work/cache-$2")" ] || { echo "FAIL: something was built at run time: $(ls -R "$work/cache-$2")"; exit 1; }
}
fresh_env "$work/env"
(cd "$work" && "$work/env/bin/python" -m pip install --no-build-isolation -q "$src") >"$work/install.log" 2>&1 \
  || { tail -40 "$work/install.log"; echo "FAIL: pip install"; exit 1; }
grep "fragless:" "$work/install.log" || true
check "$work/env" install
"$work/env/bin/python" -m pip uninstall -y -q fragless
left="$(find "$work/env/lib" -iname '*fragless*')"
[ -z "$left" ] || { echo "FAIL: pip uninstall left: $left"; exit 1; }
echo "ok: pip uninstall fragless removed everything"
(cd "$work" && "$work/env/bin/python" -m pip wheel --no-build-isolation --no-deps -q -w "$work/wheels" "$src") \
  >"$work/wheel.log" 2>&1 || { tail -40 "$work/wheel.log"; echo "FAIL: pip wheel"; exit 1; }
wheel="$(ls "$work"/wheels/fragless-*.whl)"
echo "wheel: $(basename "$wheel")"
fresh_env "$work/env2"
"$work/env2/bin/python" -m pip install -q "$wheel"
check "$work/env2" wheel
echo "ok: pip install, uninstall and a wheel, offline, from outside the tree"
