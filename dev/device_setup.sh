#!/usr/bin/env bash
# Once per checkout, on this (x86-64) machine: what a bare H200 device machine lacks, into
# git-ignored folders that device calls carry (dev/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
for d in /.whl/ /.gl/ /.devrun/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
mkdir -p .whl .gl .devrun
# wgpu-native and Dawn for the device's Python 3.12, with what they need there (pinned: the
# versions of docs/gpu_h200.txt; one version of each, or the install stops)
plat=""
for n in 17 24 27 28 31 34; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
for w in wgpu==0.32.0 wgpudawn==0.32.0.4 cffi==2.1.1 pycparser==3.12 rendercanvas==2.7.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $plat --platform manylinux2014_x86_64 -d .whl "$w"
done
# the Vulkan / GL loaders (the device image has NVIDIA's driver but not libvulkan)
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
mkdir -p /tmp/amd64/partial
apt-get $o update -qq
(cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
# the anchors, beside our bench in every call
if [ -d ../shared/anchors ]; then
  rm -rf .devrun/anchors && cp -r ../shared/anchors .devrun/anchors
fi
ls .whl .gl
