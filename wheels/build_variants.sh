#!/usr/bin/env bash
# The two other builds of the compiled core, each from a clean copy of the sources
# (wheels/copy_source.py), built in place and checked with the CPU tests:
#
#  no-openmp  MAMBA_EXT_NO_OPENMP=1 with the default compiler: builds with its warning,
#             no module links an OpenMP runtime, `omp simd` loops still vectorised
#             (-fopenmp-simd), block and model results bitwise equal to the main build;
#  clang      CC=clang (skipped when clang is absent, FAILS under CI=true): OpenMP found
#             with clang itself (libomp), the hot kernels dispatched at run time
#             (AVX-512 / AVX2 / baseline clones on x86_64 Linux), tests and gradcheck pass.
#
# Checked with each: tests/cpu (every kernel against the float64 reference) and gradcheck.
# Usage:  wheels/build_variants.sh [no-openmp] [clang]     (both by default)
# Env:    PYTHON (python3: an environment with the build and test requirements installed
#         and mamba_ext itself built, e.g. CI's venv), KEEP_WORK=1 keeps the copies.
# Timings are not measured here: the machine this runs on is shared.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d -t mamba_ext_variants.XXXXXX)"
[ "${KEEP_WORK:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
VARIANTS=("$@"); [ ${#VARIANTS[@]} -gt 0 ] || VARIANTS=(no-openmp clang)
START=$SECONDS
step() { printf '\n==> %s\n' "$*"; }
die() { printf 'FAILED: %s\n' "$*" >&2; exit 1; }
HOT=(mx_scan_forward_chunk_f mx_scan_backward_chunk_f)   # clones looked for in scan's module

# Bitwise fingerprint of block (f32/f64, zoh/euler) and model results of the build on PYTHONPATH.
fingerprint() {
  (cd "$WORK" && PYTHONPATH="$1" "$PYTHON" - <<'PYEOF'
import hashlib, numpy as np, mamba_ext
from mamba_ext import (init_mamba1_params, init_model_params, mamba1_backward, mamba1_forward,
                       model_loss_and_grads)
h = hashlib.sha256()
for dt in (np.float32, np.float64):
    for disc in ("zoh", "euler"):
        p = init_mamba1_params(48, d_state=16, expand=3, seed=1, dtype=dt)
        x = np.random.default_rng(0).standard_normal((2, 150, 48)).astype(dt)
        out, cache = mamba1_forward(x, p, discretization=disc, n_threads=1)
        dx, g = mamba1_backward(0.1 * x, p, cache, n_threads=1)
        for a in (out, dx, *g.values()):
            h.update(np.ascontiguousarray(a).tobytes())
    mp = init_model_params(50, 32, 2, seed=3, dtype=dt)
    tok = np.random.default_rng(1).integers(0, 50, (2, 70))
    loss, grads = model_loss_and_grads(tok, np.roll(tok, -1), mp, n_threads=1)[:2]
    h.update(np.float64(loss).tobytes())
    for a in grads.values():
        h.update(np.ascontiguousarray(a).tobytes())
print(mamba_ext.__file__.rsplit("/mamba_ext/", 1)[0], h.hexdigest()[:16])
PYEOF
  )
}

build_copy() {  # $1: name, rest: env assignments for the build
  local name=$1; shift
  "$PYTHON" "$REPO/wheels/copy_source.py" "$REPO" "$WORK/$name" >/dev/null
  (cd "$WORK/$name" && env "$@" "$PYTHON" setup.py build_ext --inplace >"$WORK/$name.log" 2>&1) \
    || { tail -30 "$WORK/$name.log"; die "$name build (log above)"; }
}

run_tests() {  # $1: source copy
  (cd "$WORK" && PYTHONPATH="$1" "$PYTHON" -m pytest -q -p no:cacheprovider \
     "$1/tests/cpu" 2>&1 | tail -1) || die "tests of $1"
  (cd "$WORK" && PYTHONPATH="$1" "$PYTHON" -m mamba_ext gradcheck | tail -1) || die "gradcheck of $1"
}

step "reference: the build found by $PYTHON"
REF="$(cd "$WORK" && "$PYTHON" -c 'import mamba_ext, os; print(os.path.dirname(os.path.dirname(mamba_ext.__file__)))')"
fingerprint "$REF" | tee "$WORK/ref.fp"

for v in "${VARIANTS[@]}"; do
  case $v in
  no-openmp)
    step "no-openmp: MAMBA_EXT_NO_OPENMP=1"
    build_copy no-openmp MAMBA_EXT_NO_OPENMP=1
    grep -q "OpenMP disabled" "$WORK/no-openmp.log" || die "no build-time OpenMP warning"
    grep -q -- "-fopenmp-simd" "$WORK/no-openmp.log" || echo "   (the compiler has no -fopenmp-simd)"
    for so in "$WORK"/no-openmp/mamba_ext/cpu/*.so; do
      if command -v readelf >/dev/null && readelf -d "$so" | grep -E "NEEDED.*(gomp|omp)" >/dev/null; then
        die "$(basename "$so") links an OpenMP runtime"
      fi
    done
    echo "   no module links an OpenMP runtime"
    run_tests "$WORK/no-openmp"
    fp="$(fingerprint "$WORK/no-openmp")"
    [ "${fp#* }" = "$(cut -d' ' -f2 "$WORK/ref.fp")" ] || die "no-openmp results differ from the main build"
    echo "   results bitwise equal to the main build ($fp)"
    ;;
  clang)
    step "clang: CC=clang"
    if ! command -v clang >/dev/null; then
      [ "${CI:-}" = true ] && die "clang not found (CI installs clang and libomp-dev)"
      echo "   clang not found: skipped"; continue
    fi
    clang --version | head -1 | sed 's/^/   /'
    build_copy clang CC=clang
    if grep -q "WITHOUT OpenMP" "$WORK/clang.log"; then
      [ "${CI:-}" = true ] && die "clang build without OpenMP (install libomp-dev)"
      echo "   (clang has no OpenMP here: libomp-dev missing)"
    fi
    so="$(ls "$WORK"/clang/mamba_ext/cpu/scan.*.so)"
    if [ "$(uname -m)" = x86_64 ] && [ "$(uname -s)" = Linux ]; then
      for k in "${HOT[@]}"; do
        for isa in avx512f avx2 default; do
          nm "$so" | grep -q " $k\.$isa" || die "clang build: no $isa clone of $k"
        done
      done
      echo "   runtime dispatch: avx512f / avx2 / default clones of ${HOT[*]}"
    fi
    run_tests "$WORK/clang"
    fp="$(fingerprint "$WORK/clang")"
    echo "   results fingerprint $fp (reference $(cut -d' ' -f2 "$WORK/ref.fp"); not compared:"
    echo "   another compiler may contract and order floating point differently)"
    ;;
  *) die "unknown variant $v (no-openmp, clang)" ;;
  esac
done
step "build variants passed in $((SECONDS - START)) s"
