#!/usr/bin/env bash
# Prepare, on the machine that calls the device tool, what tests/training/scaling_bench.sh
# needs on the two-H200 host (which reaches no package index): run in the repository root.
#   .whl/      wgpu + cffi + pycparser + rendercanvas (GPU ranks), Cython (the build), for CPython 3.12
#   .whl/mpi/  mpi4py + the mpich wheel: used there only if the host's own MPI does not work
#   .gl/       the Vulkan/EGL loaders (the device README's recipe)
# Both folders are in .gitignore; name them in the run's `carry`: [".whl", ".gl"].
set -euo pipefail
cd "$(dirname "$0")/../.."
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
rm -rf .whl && mkdir -p .whl/mpi
python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl \
  wgpu==0.32.0 cffi pycparser rendercanvas "Cython>=3.1"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl/mpi "mpi4py>=4.0" mpich
if ! ls .gl/*.deb >/dev/null 2>&1; then
  LISTS=$(mktemp -d)            # own package lists: other users of /tmp/amd64 hold its lock
  mkdir -p .gl "$LISTS/partial"
  o="-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=$LISTS"
  apt-get $o update -qq
  (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
fi
du -sh .whl .gl
