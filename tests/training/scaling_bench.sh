#!/usr/bin/env bash
# Scaling table of data-parallel training (docs/distributed.md, issue 11) on ONE host:
#   cpu: model 4x256, CPU ranks P = 1 2 4 8 16 (as many as the cores allow)
#        weak   = per-rank batch 16 x 256, 2 threads per rank (each rank the same resources)
#        strong = global batch 64 x 256, the host's cores divided among the ranks
#   gpu: model 24x768, GPU ranks P = 1 2 (one adapter per rank), per-rank batch 8 x 1024 and 4 x 1024
# Prints one row per run, then the table with speed-ups and efficiencies; keeps the logs
# and JSON lines in $OUT (the device tool's folder) or /tmp/scaling_bench.
#
# Usage, in the repository root:   tests/training/scaling_bench.sh [cpu|gpu|all]
# On a machine without a package index, first run tests/training/scaling_bench_prep.sh
# where pip works and carry .whl (wheels) and .gl (Vulkan loader): see docs/distributed.md.
# Env: PYTHON (default python3), STEPS (default 6), CPU_P / GPU_P (lists of P).
set -uo pipefail
cd "$(dirname "$0")/../.."
WHAT=${1:-all}
PY=${PYTHON:-python3}
RES=${OUT:-/tmp/scaling_bench}
mkdir -p "$RES"
JSON="$RES/scaling.jsonl"
: > "$JSON"
NCORES=$(nproc)
STEPS=${STEPS:-6}
export PYTHONUNBUFFERED=1
# Open MPI refuses root without these (the device machine runs commands as root)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
log() { printf '\n== %s\n' "$*"; }

log "host: $NCORES cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
command -v nvidia-smi >/dev/null && nvidia-smi -L

# ---- carried Vulkan loader and wheels (device machine: no package index there)
if [ -d .gl ] && ! ldconfig -p | grep -q libvulkan; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "warning: the wheels in .whl do not install for $PY (made for CPython 3.12); going on without"
  fi
fi

# ---- MPI: the host's own if mpiexec and mpi4py work together, else the carried mpich wheel
mpi_flags() {
  if "$1" --version 2>&1 | grep -qiE 'open ?mpi|openrte'; then
    # Open MPI binds each rank to one core by default: our ranks run threads
    echo "--oversubscribe --bind-to none --allow-run-as-root -x PATH -x LD_LIBRARY_PATH" \
         "-x PYTHONPATH -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS"
  fi
}
mpi_works() {
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 60 "$1" $(mpi_flags "$1") -n 2 $PY -c \
    "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 2" >/dev/null 2>&1
}
MPIEXEC=$(command -v mpiexec || true)
if [ -z "$MPIEXEC" ] || ! mpi_works "$MPIEXEC"; then
  echo "host MPI: ${MPIEXEC:-no mpiexec} does not run mpi4py; using the carried mpich wheel"
  ls .whl/mpi/*.whl >/dev/null 2>&1 || { echo "no .whl/mpi wheels: run scaling_bench_prep.sh"; exit 1; }
  $PY -m pip install -q --no-index --no-deps --ignore-installed --prefix /tmp/mpich .whl/mpi/*.whl \
    || exit 1
  SP=$(ls -d /tmp/mpich/lib/python3*/site-packages)
  export PATH=/tmp/mpich/bin:$PATH LD_LIBRARY_PATH=/tmp/mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONPATH=$SP${PYTHONPATH:+:$PYTHONPATH}
  MPIEXEC=/tmp/mpich/bin/mpiexec
  mpi_works "$MPIEXEC" || { echo "the carried mpich does not work either"; exit 1; }
fi
FLAGS=$(mpi_flags "$MPIEXEC")
log "MPI: $MPIEXEC $FLAGS"
$PY -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"

# ---- build the compiled modules in place (kept between calls on a warm machine)
log "build mamba_ext in place"
$PY setup.py -q build_ext --inplace -j "$NCORES" >"$RES/build.log" 2>&1 \
  || { tail -40 "$RES/build.log"; exit 1; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

run() {  # THREADS P ARGS... : one mpiexec job, one row
  local T=$1 P=$2
  shift 2
  OMP_NUM_THREADS=$T OPENBLAS_NUM_THREADS=$T timeout 400 "$MPIEXEC" $FLAGS -n "$P" \
    $PY -m mamba_ext.bench.distributed --json "$JSON" --threads "$T" --steps "$STEPS" "$@" \
    >>"$RES/runs.log" 2>&1
  local rc=$?
  grep 'tok/s' "$RES/runs.log" | tail -1
  [ $rc -eq 0 ] || { echo "FAILED (rc $rc): P=$P $*; last lines of $RES/runs.log:"; tail -15 "$RES/runs.log"; }
}

if [ "$WHAT" = cpu ] || [ "$WHAT" = all ]; then
  log "CPU ranks, model 4x256"
  for P in ${CPU_P:-1 2 4 8 16}; do
    [ $((P * 2)) -le "$NCORES" ] && run 2 "$P" --label weak --model 4x256 --batch 16 --seq-len 256
  done
  for P in ${CPU_P:-1 2 4 8 16}; do
    [ "$P" -le "$NCORES" ] && run $((NCORES / P)) "$P" --label strong --model 4x256 \
      --global-batch 64 --seq-len 256
  done
fi

if [ "$WHAT" = gpu ] || [ "$WHAT" = all ]; then
  log "GPU ranks, model 24x768"
  gpu_ok() { $PY -c "import sys, mamba_ext.gpu as g; sys.exit(0 if g.available() else 1)" 2>/dev/null; }
  if ! gpu_ok; then   # the device README's fallback for the NVIDIA Vulkan driver
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  fi
  if gpu_ok; then
    $PY -c "import wgpu; from mamba_ext.gpu.device import _adapters; \
print('adapters:', [a.info['device'] for a in _adapters(wgpu)])"
    for b in 8 4; do
      for P in ${GPU_P:-1 2}; do
        run 4 "$P" --label "gpu-b$b" --device gpu --model 24x768 --batch "$b" --seq-len 1024 --warmup 2
      done
    done
  else
    echo "no GPU adapter found by wgpu: GPU runs skipped"
  fi
fi

log "scaling table (tokens/s of the whole job; efficiency = tokens/s / (P x tokens/s at P=1))"
$PY - "$JSON" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
base = {}
for r in rows:
    if r["P"] == 1:
        base[(r["label"], r["model"])] = r
print(f"| run | model | P | b | G | threads | tokens/s | speed-up | efficiency | step ms | "
      f"compute ms | all-reduce ms (in step) | all-reduce alone ms | grad MB | bus GB/s | "
      f"GPU staging ms | TFLOP/s per rank (6N) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    b1 = base.get((r["label"], r["model"]))
    sp = r["tokens_per_s"] / b1["tokens_per_s"] if b1 else float("nan")
    print(f"| {r['label']} | {r['model']} | {r['P']} | {r['b']} | {r['G']} | {r['threads']} | "
          f"{r['tokens_per_s']:.0f} | {sp:.2f} | {sp / r['P']:.2f} | {r['step_s'] * 1e3:.1f} | "
          f"{r['compute_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} | {r['allreduce_alone_s'] * 1e3:.2f} | "
          f"{r['grad_bytes'] / 1e6:.1f} | {r['busbw_GBps']:.2f} | {r['staging_s'] * 1e3:.1f} | "
          f"{r['flops_per_rank'] / 1e12:.3f} |")
if rows:
    print(f"\nMPI: {rows[0]['mpi']}; GPU adapter(s): "
          f"{sorted({r['adapter'] for r in rows if r['device'] == 'gpu'}) or 'none'}")
EOF
