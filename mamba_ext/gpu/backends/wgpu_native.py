"""The wgpu-native backend (wgpu-py, the default): its private fast paths through the
cffi handle of wgpu-native's C API, each optional (None, or AttributeError/ImportError
from the constructor, where the installed wgpu-py does not have it; device.py then goes
through wgpu-py's public methods)."""
from __future__ import annotations

import numpy as np

NAME = "wgpu"
# device features asked for beyond timestamp-query, where the adapter has them
FEATURES = ("subgroup",)
# the feature that allows subgroup builtins, and the directive a kernel calling them starts
# with: none (naga takes them without one and refuses "enable subgroups;")
SUBGROUP_FEATURE = "subgroup"
SUBGROUP_DIRECTIVE = ""
# whether two threads may call the device at once (wgpu-native's devices are)
THREAD_SAFE = True
# whether a map's promise is resolved by a thread of the backend's own (wgpu-py's poller, which
# sets the promise's ``_thread_event``), so that a caller may wait for it in slices
POLLED_MAPS = True

# Runtime checks naga adds to the shaders, as wgpu-native's WGPUShaderRuntimeChecks bits
# (None: wgpu's default, create_shader_module); see SHADER_CHECKS in device.py.
SHADER_CHECK_BITS = {"full": None, "bounds": 1, "none": 0}


def module():
    """The wgpu-py API module."""
    import wgpu
    return wgpu


def prepare(checks: str) -> None:
    """Set-up before the first adapter is requested: nothing for wgpu-native."""


def subgroup_matrix_configs(adapter):
    """wgpu-native offers no subgroup matrices (kernels/linear_f16.wgsl): []."""
    return []


def native_queue(device):
    """A NativeQueue, or None where wgpu-native's entry points for it are missing."""
    try:
        return NativeQueue(device)
    except (ImportError, AttributeError):
        return None


def shader_module(device, label: str, code: str, checks: str):
    """The shader module of WGSL ``code`` with the runtime ``checks`` (SHADER_CHECKS of
    mamba_ext.gpu.device): through wgpuDeviceCreateShaderModuleTrusted where the checks
    are fewer than wgpu's default and the entry point exists."""
    bits = SHADER_CHECK_BITS[checks]
    trusted = None
    if bits is not None:
        try:   # wgpu-py's wgpu-native backend: its cffi handle and module class
            from wgpu.backends.wgpu_native import _api
            from wgpu.backends.wgpu_native._ffi import ffi, lib
            trusted = lib.wgpuDeviceCreateShaderModuleTrusted
            internal = device._internal
        except (ImportError, AttributeError):
            trusted = None
    if trusted is None:
        return device.create_shader_module(label=label, code=code)
    text, name = code.encode(), label.encode()
    text_c, name_c = ffi.new("char[]", text), ffi.new("char[]", name)
    src = ffi.new("WGPUShaderSourceWGSL *")
    src.chain.next = ffi.NULL
    src.chain.sType = lib.WGPUSType_ShaderSourceWGSL
    src.code.data, src.code.length = text_c, len(text)
    desc = ffi.new("WGPUShaderModuleDescriptor *")
    desc.nextInChain = ffi.cast("WGPUChainedStruct *", src)
    desc.label.data, desc.label.length = name_c, len(name)
    handle = trusted(internal, desc, bits)
    if handle == ffi.NULL:
        raise RuntimeError(f"mamba_ext.gpu: shader module {label!r} could not be created")
    return _api.GPUShaderModule(label, handle, device)


def native_dispatch():
    """A function recording ops into a compute pass by wgpu-native's C entry points
    directly, or None where the backend is not wgpu-native. Why: wgpu-py wraps every
    call in a Python error-capture proxy, about half of the host's cost of a
    dispatch (block c's 43: 12-14 -> 5-10 us each on the H200 host; 5.2 -> 3.5 us
    here with lavapipe);
    the checks are not lost: wgpu-core validates a pass when its encoder finishes
    (``finish`` stays wgpu-py's, which raises GPUValidationError, e.g. for a grid
    above max_compute_workgroups_per_dimension)."""
    try:
        from wgpu.backends.wgpu_native._ffi import ffi, lib
        set_pipeline = lib.wgpuComputePassEncoderSetPipeline
        set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
        dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
    except (ImportError, AttributeError):
        return None
    null = ffi.NULL

    def record(cp, ops):
        h = cp._internal
        for op in ops:
            set_pipeline(h, op.pipeline._internal)
            set_bind_group(h, 0, op.bind_group._internal, 0, null)
            dispatch(h, *op.grid)
    return record


class NativeQueue:
    """Submits that return their submission index, and the read-back of a MAP_READ buffer
    that waits for exactly the submission that wrote it, by wgpu-native's entry points.

    Why: wgpu-py's ``map_sync`` waits on the device for the *last* submission. A trainer
    that submits step s+1 before reading back step s (ResidentTrainer.step_async) would
    then wait for s+1 too, and the GPU idle while the host prepares s+2 (H200, 4 x 256
    model: 9.8-9.9 ms per step against 9.2 with this). Here the
    map is started with wgpuBufferMapAsync and the device polled until that submission is
    done (wgpuDevicePoll with its index), which fires the map's callback; the bytes are
    copied out and the buffer unmapped. wgpu-py's own object never sees the map (its
    state stays "unmapped", which is what it is again afterwards)."""

    def __init__(self, device):
        from wgpu.backends.wgpu_native._ffi import ffi, lib
        self.ffi, self.lib = ffi, lib
        self.device, self.queue = device._internal, device.queue._internal
        for name in ("wgpuQueueSubmitForIndex", "wgpuDevicePoll", "wgpuBufferMapAsync",
                     "wgpuBufferGetConstMappedRange", "wgpuBufferUnmap"):
            getattr(lib, name)                      # AttributeError: not this backend
        self._status = {}

        @ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
        def mapped(status, message, user1, user2):
            self._status[int(ffi.cast("uintptr_t", user1))] = int(status)
        self._mapped = mapped                       # kept alive with this object

    def submit(self, command_buffer) -> int:
        """Submit one command buffer; returns its submission index."""
        arr = self.ffi.new("WGPUCommandBuffer[]", [command_buffer._internal])
        return int(self.lib.wgpuQueueSubmitForIndex(self.queue, 1, arr))

    def read(self, buffer, nbytes, index=None) -> np.ndarray:
        """The first ``nbytes`` of the MAP_READ ``buffer`` (bytes, uint8), once submission
        ``index`` (None: everything submitted) is done."""
        ffi, lib = self.ffi, self.lib
        key = len(self._status) + 1
        while key in self._status:
            key += 1
        self._status[key] = None
        info = ffi.new("WGPUBufferMapCallbackInfo *")
        info.mode = lib.WGPUCallbackMode_AllowProcessEvents
        info.callback = self._mapped
        info.userdata1 = ffi.cast("void *", key)
        try:
            lib.wgpuBufferMapAsync(buffer._internal, lib.WGPUMapMode_Read, 0, nbytes, info[0])
            which = ffi.NULL if index is None else ffi.new("WGPUSubmissionIndex *", index)
            lib.wgpuDevicePoll(self.device, True, which)
            for _ in range(100):                    # done, but its callback not yet run:
                if self._status[key] is not None:   # wait for everything (a bounded number
                    break                           # of times: a lost device must not hang)
                lib.wgpuDevicePoll(self.device, True, ffi.NULL)
            if self._status[key] is None:
                raise RuntimeError("mamba_ext.gpu: a read-back buffer was never mapped (the "
                                   "device may be lost)")
            if self._status[key] != lib.WGPUMapAsyncStatus_Success:
                raise RuntimeError(f"mamba_ext.gpu: mapping a read-back buffer failed "
                                   f"(WGPUMapAsyncStatus {self._status[key]})")
            try:                                    # mapped: unmapped again whatever happens
                ptr = lib.wgpuBufferGetConstMappedRange(buffer._internal, 0, nbytes)
                if ptr == ffi.NULL:
                    raise RuntimeError("mamba_ext.gpu: a mapped read-back buffer gave no range")
                return np.frombuffer(ffi.buffer(ptr, nbytes), np.uint8).copy()
            finally:
                lib.wgpuBufferUnmap(buffer._internal)
        finally:
            del self._status[key]
