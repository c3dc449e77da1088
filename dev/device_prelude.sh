# Sourced first by every device command (dev/README.md): the loaders, the wheels, NVIDIA's
# Vulkan driver, and the extension built for the device's Python (3.12, 16 cores).
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES="$icd"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 setup.py build_ext --inplace -j 16 > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; return 1; }
