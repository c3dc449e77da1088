#!/usr/bin/env bash
# Portability check of the C of the CPU kernels, on this (x86_64 Linux) machine only:
#
#  1. every header of mamba_ext/cpu/csrc compiles on its own (ISO C99 and C11, -pedantic)
#     for aarch64-macos, x86_64-windows-gnu and aarch64-linux-gnu, warnings as errors;
#  2. the C tests tests/csrc/test_mx_*.c compile for the same three targets (compile only:
#     linking would first build each target's C runtime, minutes on a cold zig cache);
#  3. they are built as static aarch64-linux and x86_64-linux (musl) binaries, run under
#     qemu-aarch64-static and natively; each must print "OK (0 failures)" and both
#     architectures must print the same text (-ffp-contract=off: same float results);
#  4. every loop of the float32 kernels (MX_KERNEL ..._f) vectorises for arm64 (NEON) at
#     -O3: Clang's -Rpass-missed=loop-vectorize reports none.
#
# The cross compiler is `zig cc` from the `ziglang` wheel (PyPI; installed into $PYTHON's
# environment when missing); qemu-aarch64-static comes from Debian's qemu-user-static.
# OpenMP's runtime is not cross-built: the `omp simd` loops are compiled with
# -fopenmp-simd -DMX_OPENMP_SIMD (what setup.py does for builds without OpenMP).
#
# Usage:  wheels/cross_check.sh          Env: PYTHON (python3), QEMU (qemu-aarch64-static),
#                                              THIN (16: test_mx_math sweep thinning),
#                                              ZIGLANG_VERSION (0.17.1, when not installed)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
QEMU="${QEMU:-qemu-aarch64-static}"
THIN="${THIN:-16}"
CSRC="$REPO/mamba_ext/cpu/csrc"
TESTS="$REPO/tests/csrc"
WORK="$(mktemp -d -t mamba_ext_cross.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
FAILED=()
step() { printf '\n==> %s\n' "$*"; }
fail() { printf 'FAILED: %s\n' "$*" >&2; FAILED+=("$*"); }

"$PYTHON" -m ziglang version >/dev/null 2>&1 || "$PYTHON" -m pip install -q "ziglang==${ZIGLANG_VERSION:-0.17.1}"
ZIG=("$PYTHON" -m ziglang cc)
echo "zig $("$PYTHON" -m ziglang version), $(command -v "$QEMU" || echo "no $QEMU")"
command -v "$QEMU" >/dev/null || { echo "FAILED: $QEMU not found (apt-get install qemu-user-static)" >&2; exit 1; }

CFLAGS=(-Wall -Wextra -Werror -O2 -ffp-contract=off -fopenmp-simd -DMX_OPENMP_SIMD -I "$CSRC")
TARGETS=(aarch64-macos x86_64-windows-gnu aarch64-linux-gnu)
HEADERS=("$CSRC"/*.h)
PROGRAMS=("$TESTS"/test_mx_*.c)

step "1. ${#HEADERS[@]} headers alone, C99 and C11 -pedantic, for ${TARGETS[*]}"
for target in "${TARGETS[@]}"; do
  for h in "${HEADERS[@]}"; do
    printf '#include "%s"\nint mx_translation_unit_not_empty;\n' "$(basename "$h")" > "$WORK/tu.c"
    for std in c99 c11; do
      "${ZIG[@]}" -target "$target" -std=$std -pedantic "${CFLAGS[@]}" -c "$WORK/tu.c" \
        -o "$WORK/tu.o" || fail "$(basename "$h") -std=$std for $target"
    done
  done
  echo "   $target: ok"
done

step "2. ${#PROGRAMS[@]} C test programs compiled for ${TARGETS[*]}"
for target in "${TARGETS[@]}"; do
  for src in "${PROGRAMS[@]}"; do
    "${ZIG[@]}" -target "$target" -std=c11 "${CFLAGS[@]}" -c "$src" \
      -o "$WORK/$(basename "$src" .c).$target.o" || fail "$(basename "$src") for $target"
  done
  echo "   $target: ok"
done

step "3. static aarch64 (qemu) and x86_64 (native) binaries: run and compare"
for src in "${PROGRAMS[@]}"; do
  p="$(basename "$src" .c)"
  args=(); [ "$p" = test_mx_math ] && args=("$THIN")
  for arch in aarch64 x86_64; do
    "${ZIG[@]}" -target $arch-linux-musl -static -std=c11 "${CFLAGS[@]}" "$src" \
      -o "$WORK/$p.$arch" -lm || fail "$p: static $arch build"
  done
  "$WORK/$p.x86_64" "${args[@]}" > "$WORK/$p.x86_64.out" 2>&1 || fail "$p on x86_64"
  "$QEMU" "$WORK/$p.aarch64" "${args[@]}" > "$WORK/$p.aarch64.out" 2>&1 || fail "$p on aarch64 (qemu)"
  if ! cmp -s "$WORK/$p.x86_64.out" "$WORK/$p.aarch64.out"; then
    fail "$p: aarch64 output differs from x86_64"
    diff "$WORK/$p.x86_64.out" "$WORK/$p.aarch64.out" | head -20 || true
  fi
  printf '   %-22s %s\n' "$p" "$(tail -1 "$WORK/$p.aarch64.out")"
done
sed 's/^/   aarch64: /' "$WORK/test_mx_math.aarch64.out" | head -5

step "4. float32 kernels vectorised for arm64 (NEON)"
KERNELS=$(grep -ho 'MX_KERNEL void mx_[a-z0-9_]*_##SFX' "${HEADERS[@]}" | sed 's/MX_KERNEL void //; s/_##SFX$/_f/' | sort -u)
{
  for h in "${HEADERS[@]}"; do printf '#include "%s"\n' "$(basename "$h")"; done
  printf 'typedef void (*mx_any_fn)(void);\nmx_any_fn mx_float_kernels[] = {\n'
  for k in $KERNELS; do printf '    (mx_any_fn)%s,\n' "$k"; done
  printf '};\n'
} > "$WORK/kernels_f.c"
"${ZIG[@]}" -target aarch64-linux-gnu -std=c11 "${CFLAGS[@]}" -O3 -fno-math-errno \
  -Rpass=loop-vectorize -Rpass-missed=loop-vectorize -c "$WORK/kernels_f.c" -o "$WORK/kernels_f.o" \
  2> "$WORK/vec.log" || { cat "$WORK/vec.log"; fail "float32 kernels for aarch64"; }
n_vec=$(grep -c "remark: vectorized loop" "$WORK/vec.log" || true)
n_missed=$(grep -c "remark: loop not vectorized" "$WORK/vec.log" || true)
echo "   $(echo $KERNELS | wc -w) kernels: $n_vec loops vectorised, $n_missed not"
[ "$n_missed" = 0 ] && [ "$n_vec" -gt 0 ] || { grep "not vectorized" "$WORK/vec.log" | head; fail "a float32 kernel loop is not vectorised for arm64"; }

if [ ${#FAILED[@]} -gt 0 ]; then
  printf '\n%d check(s) FAILED:\n' ${#FAILED[@]}; printf '  - %s\n' "${FAILED[@]}"; exit 1
fi
step "cross check passed in $((SECONDS - START)) s"
