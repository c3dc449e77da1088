"""The one wgpu device of mamba_ext.gpu: adapter limits, kernel loading, the
pipeline cache, buffers and dispatch recording, and the dispatch helpers every
step module uses (:func:`elementwise`, :func:`column_sum`, :func:`arena_layout`).

Everything that touches wgpu goes through :func:`gpu` (created lazily, once per
process), on the WebGPU implementation that ``MAMBA_EXT_GPU_BACKEND`` selects
(``backends/``: wgpu-native by default, or Dawn); this module uses only the wgpu-py API,
and each backend's private calls live in its own module. Kernels are WGSL files of the
package ``mamba_ext.kernels`` (the
repository's ``kernels/`` folder, mapped by ``package_dir`` in setup.py), read
with importlib.resources; each pipeline is compiled once per (file, entry point,
override constants) and cached.

The step modules mirror ``mamba_ext/cpu/``: ``rmsnorm``, ``linear``, ``conv1d``,
``scan``, ``activations``, ``block``, ``model``, ``adamw`` (+ ``trainer``), each
dispatching the kernels of ``kernels/<same name>.wgsl``.

Size letters: M = B*L rows.
"""
from __future__ import annotations

import math
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NO_ADAPTER_HELP = (
    "mamba_ext.gpu: wgpu found no GPU adapter. Install a driver with Vulkan, Metal or "
    "DirectX 12 support for your GPU, or the software Vulkan driver lavapipe "
    "(Debian/Ubuntu: apt-get install mesa-vulkan-drivers; Fedora: dnf install "
    "mesa-vulkan-drivers), then retry. mamba_ext.gpu.available() says whether one is found.")

# Limits we ask for beyond WebGPU's defaults (the defaults are far below what
# real GPUs offer: 128 MiB bindings, 8 storage buffers per stage).
_WANTED_LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size",
                  "max-storage-buffers-per-shader-stage", "max-compute-workgroup-storage-size",
                  "max-compute-invocations-per-workgroup", "max-compute-workgroup-size-x",
                  "max-compute-workgroups-per-dimension")

# Dispatches of the first command buffer of a submit, and the most of any (Gpu.submit).
SUBMIT_FIRST = 16
SUBMIT_MAX = 128

# The scan backward kernel binds 11 storage buffers.
_MIN_STORAGE_BUFFERS = 11

# Runtime checks naga adds to our shaders (wgpu-native's WGPUShaderRuntimeChecks bits),
# chosen by MAMBA_EXT_GPU_CHECKS:
#   "full"   wgpu's default (device.create_shader_module): index clamps on every array
#            access the driver does not bound itself, AND a 64-bit counter in every
#            loop ("force loop bounding", wgpu >= 25), which keeps the driver's compiler
#            from unrolling loops and from keeping small arrays in registers;
#   "bounds" the index clamps only (the default): our loops all end (their trip counts
#            come from sizes checked on the host), and a counter that breaks after 2^64
#            iterations guards against nothing in practice;
#   "none"   neither (our kernels guard their own ranges; buffers stay protected by the
#            driver's robust buffer access where wgpu enables it).
# "bounds" and "none" go through wgpuDeviceCreateShaderModuleTrusted; where wgpu's
# backend does not offer it, every choice falls back to "full" (backends/wgpu_native.py).
# (Dawn: see backends/dawn.py.)
SHADER_CHECKS = ("full", "bounds", "none")


def kernel_dir():
    """The folder of the WGSL sources (a :class:`pathlib.Path` or an importlib.resources
    Traversable: ``joinpath``, ``iterdir``, ``read_text``).

    Installed wheels hold the kernels as package data of ``mamba_ext.kernels`` (a
    namespace package: no ``__init__.py``, see setup.py). In a source checkout used
    through ``PYTHONPATH=<repo>``, or installed editable (``pip install -e .``, whose
    finder maps no namespace package), that package does not exist, so we fall back to
    ``<repo>/kernels`` next to the package.
    """
    try:
        from importlib.resources import files
        root = files("mamba_ext.kernels")
        if root.joinpath("common.wgsl").is_file():
            return root
    except (ModuleNotFoundError, FileNotFoundError, TypeError):
        pass
    repo_kernels = Path(__file__).resolve().parents[2] / "kernels"
    if not (repo_kernels / "common.wgsl").is_file():
        raise RuntimeError(f"mamba_ext.gpu: WGSL kernels not found (neither package "
                           f"mamba_ext.kernels nor {repo_kernels})")
    return repo_kernels


def _kernel_dir_sources():
    """Return a function name -> WGSL text of :func:`kernel_dir`."""
    root = kernel_dir()
    return lambda name: root.joinpath(name).read_text(encoding="utf-8")


_INCLUDE = re.compile(r"^// #include (\w+\.wgsl)[ \t]*$", re.M)


def expand_includes(text: str) -> str:
    """``text`` with every ``// #include NAME.wgsl`` line replaced by ``kernels/NAME.wgsl``
    (WGSL has no include)."""
    if "// #include" not in text:
        return text
    read = _kernel_dir_sources()
    return _INCLUDE.sub(lambda m: read(m.group(1)), text)


def kernel_source(file: str) -> str:
    """WGSL of ``kernels/<file>.wgsl`` with ``common.wgsl`` prepended and its includes
    expanded (:func:`expand_includes`)."""
    read = _kernel_dir_sources()
    return read("common.wgsl") + "\n" + expand_includes(read(file + ".wgsl"))


_STORAGE = re.compile(r"@group\(0\)\s*@binding\((\d+)\)\s*var<storage\s*,\s*(read_write|read)\s*>")
_ACCESS = {}


def binding_access(file: str) -> dict:
    """{binding: True for read_write, False for read} of the storage bindings of
    ``kernels/<file>.wgsl`` (one table per file: its entry points share the declarations)."""
    acc = _ACCESS.get(file)
    if acc is None:
        acc = _ACCESS[file] = {int(b): m == "read_write"
                               for b, m in _STORAGE.findall(kernel_source(file))}
    return acc


def check_aliasing(file: str, entry: str, entries) -> None:
    """Refuse a dispatch that binds overlapping bytes of one buffer twice where either
    binding is writable (WebGPU forbids it: "writable storage buffer binding aliasing";
    Dawn checks it, wgpu-native does not yet). ``entries``: (binding, buffer, offset, size)."""
    acc = binding_access(file)
    for i, (bi, buf_i, off_i, n_i) in enumerate(entries):
        for bj, buf_j, off_j, n_j in entries[i + 1:]:
            if buf_i is buf_j and off_i < off_j + n_j and off_j < off_i + n_i \
                    and (acc.get(bi, False) or acc.get(bj, False)):
                raise ValueError(
                    f"{file}.{entry}: bindings {bi} and {bj} alias bytes of one buffer "
                    f"({getattr(buf_i, 'label', '')!r}) and one of them is writable; WebGPU "
                    f"forbids that")


def _subgroup_size(info) -> int:
    """The adapter's subgroup size when it has one fixed size (min = max; wgpudawn spells
    the keys ``stackgroup_*``), 32 on NVIDIA (warps are 32 wide; Dawn reports only the
    bounds 4 .. 128 there), else 0 (unknown)."""
    lo, hi = (int(info.get(f"subgroup_{k}_size") or info.get(f"stackgroup_{k}_size") or 0)
              for k in ("min", "max"))
    if lo and lo == hi:
        return hi
    if str(info.get("vendor", "")).upper().startswith("NVIDIA") or info.get("vendor_id") == 0x10DE:
        return 32
    return 0


def f16_matrix_configs(backend, adapter, features) -> list:
    """The f16 x f16 -> f32 subgroup-matrix shapes {"m", "n", "k", "subgroup"} that
    ``backend``'s ``adapter`` runs where ``features`` (the device's, or the adapter's)
    hold shader-f16 and subgroup matrices; else []."""
    if {"shader-f16", "chromium-experimental-subgroup-matrix"} <= set(features):
        return backend.subgroup_matrix_configs(adapter)
    return []


def _shader_checks() -> str:
    from .backends import env_choice
    return env_choice("MAMBA_EXT_GPU_CHECKS", SHADER_CHECKS, "bounds")


@dataclass(frozen=True)
class Slice:
    """Bytes [offset, offset + size) of a buffer, bound as a binding of their own: the kernel
    indexes them from 0. ``offset``: a multiple of 256 (WebGPU's largest allowed
    min_storage_buffer_offset_alignment, so every adapter takes it)."""
    buffer: object
    offset: int
    size: int


def slices(g, name, lengths):
    """One u32/f32 buffer holding arrays of ``lengths`` elements, each starting on a
    256-byte boundary (so one write fills them all): (buffer, [Slice per array])."""
    starts, n = [], 0
    for k in lengths:
        starts.append(n)
        n += -(-max(int(k), 1) // 64) * 64          # words, rounded up to 256 bytes
    buf = g.buffer(n, name)
    return buf, [Slice(buf, 4 * a, 4 * max(int(k), 1)) for a, k in zip(starts, lengths)]


@dataclass
class Op:
    """One recorded dispatch: pipeline, its bind group and the workgroup grid."""
    pipeline: object
    bind_group: object
    grid: tuple
    name: str
    params: object = None     # its uniform buffer (rewritten by write_params)


class Gpu:
    """The device, its limits and the caches (pipelines by shader+constants)."""

    def __init__(self):
        from . import backends
        self.backend = backends.load()
        if self.backend.NAME == "wgpu":
            try:
                import wgpu
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise RuntimeError("mamba_ext.gpu needs the wgpu package: pip install wgpu "
                                   "(or pip install mamba_ext[gpu])") from e
        wgpu = self.wgpu = self.backend.module()
        # False: one thread at a time may call the device (ResidentTrainer's streamed step
        # then queues its submits and maps before it waits, instead of a feeder thread)
        self.thread_safe = self.backend.THREAD_SAFE
        self.checks = _shader_checks()
        self.backend.prepare(self.checks)
        # one adapter per process, e.g. per MPI rank: use_adapter() (the training
        # command's --gpu-index and its ranks), else the user's MAMBA_EXT_GPU_INDEX
        index = _adapter_choice()
        self.adapter_index = int(index) if index.isdigit() else None
        adapter = open_adapter(wgpu)
        if adapter is None:
            if self.backend.NAME == "dawn":
                raise RuntimeError("mamba_ext.gpu: Dawn (MAMBA_EXT_GPU_BACKEND=dawn) found no "
                                   "adapter; it needs a Vulkan, Metal or D3D12 GPU driver (it "
                                   "does not start on Mesa 22.3's lavapipe); unset the variable "
                                   "for wgpu-native")
            raise RuntimeError(NO_ADAPTER_HELP)
        self.adapter = adapter
        self.info = dict(adapter.info)
        alim = adapter.limits
        features = [f for f in ("timestamp-query",) + self.backend.FEATURES
                    if f in adapter.features]
        req = {k: alim[k] for k in _WANTED_LIMITS if k in alim}
        if req.get("max-storage-buffers-per-shader-stage", 0) < _MIN_STORAGE_BUFFERS:
            raise RuntimeError(
                f"mamba_ext.gpu: adapter {self.info.get('device')!r} allows "
                f"{req.get('max-storage-buffers-per-shader-stage')} storage buffers per shader "
                f"stage (max_storage_buffers_per_shader_stage); the scan kernels need "
                f"{_MIN_STORAGE_BUFFERS}")
        self.device = adapter.request_device_sync(required_features=features, required_limits=req)
        lim = self.device.limits
        self.max_binding = int(lim["max-storage-buffer-binding-size"])
        self.max_buffer = int(lim["max-buffer-size"])
        self.max_groups = int(lim["max-compute-workgroups-per-dimension"])
        # bytes of workgroup memory a kernel may use (the scan sizes its blocks by it)
        self.wg_memory = int(lim.get("max-compute-workgroup-storage-size", 16384))
        # invocations a one-dimensional workgroup may have (linear_f16's tiles)
        self.max_invocations = min(int(lim.get("max-compute-invocations-per-workgroup", 256)),
                                   int(lim.get("max-compute-workgroup-size-x", 256)))
        self.timestamps = "timestamp-query" in features
        # the directive a kernel that calls subgroup builtins starts with, None where the
        # device has no subgroups (Dawn: "enable subgroups;"; wgpu-native's naga takes the
        # builtins with no directive and refuses that one)
        self.subgroup_directive = (self.backend.SUBGROUP_DIRECTIVE
                                   if self.backend.SUBGROUP_FEATURE in features else None)
        # f16 x f16 -> f32 subgroup-matrix shapes {"m", "n", "k", "subgroup"} this device
        # runs (kernels/linear_f16.wgsl; empty where the backend or the adapter has none)
        self.f16_matrices = f16_matrix_configs(self.backend, adapter, features)
        # the subgroup size compute pipelines run with, where it is known (else 0):
        # kernels/linear_f16.wgsl lays its subgroups out by it (and checks it); the one
        # the subgroup-matrix shapes state, else what the adapter info allows
        fixed = {c.get("subgroup", 0) for c in self.f16_matrices} - {0}
        self.subgroup_size = fixed.pop() if len(fixed) == 1 else _subgroup_size(self.info)
        self._record = self.backend.native_dispatch()         # None: through wgpu-py's methods
        self._native = self.backend.native_queue(self.device)  # None: submits and maps too
        self._pipelines = {}
        self._modules = {}
        self.bytes_allocated = 0

    # ------------------------------------------------------------ pipelines
    def pipeline(self, file: str, entry: str, constants=None, prelude: str = ""):
        """Compute pipeline of ``entry`` in ``kernels/<file>.wgsl``, compiled once
        per (file, entry, override constants, prelude). ``prelude``: WGSL put before
        the file (``enable`` directives, which must come first, and constants that
        must be const-expressions, e.g. type parameters; its includes are expanded)."""
        key = (file, entry, tuple(sorted((constants or {}).items())), prelude)
        pl = self._pipelines.get(key)
        if pl is None:
            mkey = (file, prelude) if prelude else file
            mod = self._modules.get(mkey)
            if mod is None:
                mod = self.backend.shader_module(self.device, file,
                                                 expand_includes(prelude) + kernel_source(file),
                                                 self.checks)
                self._modules[mkey] = mod
            compute = {"module": mod, "entry_point": entry}
            if constants:
                # override constants travel as numbers (bool -> 1.0 / 0.0)
                compute["constants"] = {k: float(v) for k, v in constants.items()}
            pl = self.device.create_compute_pipeline(label=f"{file}.{entry}", layout="auto",
                                                     compute=compute)
            self._pipelines[key] = pl
        return pl

    # -------------------------------------------------------------- buffers
    def buffer(self, n_floats: int, name: str, data=None):
        """A storage buffer of ``n_floats`` 4-byte words (zero-initialised, or
        ``data``); refuses sizes above the adapter's binding limit."""
        nbytes = 4 * max(int(n_floats), 1)
        if nbytes > self.max_binding:
            raise ValueError(
                f"mamba_ext.gpu: buffer {name!r} needs {nbytes} bytes, more than this adapter's "
                f"max_storage_buffer_binding_size of {self.max_binding} bytes; use a smaller "
                f"batch or sequence length")
        usage = (self.wgpu.BufferUsage.STORAGE | self.wgpu.BufferUsage.COPY_SRC
                 | self.wgpu.BufferUsage.COPY_DST)
        nbytes = (nbytes + 15) // 16 * 16
        buf = self.device.create_buffer(label=name, size=nbytes, usage=usage)
        self.bytes_allocated += nbytes
        if data is not None:
            self.write(buf, data)
        return buf

    def uniform(self, values):
        """A uniform buffer holding ``values`` as 4-byte words (float -> f32, int -> u32)."""
        words = b"".join(struct.pack("<f", v) if isinstance(v, float) else struct.pack("<I", int(v))
                         for v in values)
        words += b"\0" * ((-len(words)) % 16)
        return self.device.create_buffer_with_data(
            data=words, usage=self.wgpu.BufferUsage.UNIFORM | self.wgpu.BufferUsage.COPY_DST)

    def write(self, buf, data, offset_bytes: int = 0):
        arr = np.ascontiguousarray(data)
        if arr.nbytes:
            self.device.queue.write_buffer(buf, offset_bytes, memoryview(arr).cast("B"))

    def read_many(self, parts):
        """float32 arrays of the first ``n`` elements of each (buffer, n) in ``parts``,
        copied into one staging buffer and mapped once (one round trip, not one per
        buffer)."""
        staging = self.staging(sum(n for _, n in parts), "read_many")
        enc = self.device.create_command_encoder()
        self._copy_out(enc, staging, parts)
        self.device.queue.submit([enc.finish()])
        out = self.read_staged(staging, [n for _, n in parts])
        staging.destroy()
        return out

    @staticmethod
    def _copy_out(enc, staging, parts):
        """Copies of the first ``n`` floats of each (buffer, n) of ``parts``, one after
        another, into ``staging``."""
        off = 0
        for buf, n in parts:
            if n:
                enc.copy_buffer_to_buffer(buf, 0, staging, off, 4 * n)
            off += 4 * n

    def read_staged(self, staging, sizes, index=None):
        """The float32 arrays of ``sizes`` elements that :meth:`_copy_out` put one after
        another into ``staging``, once the GPU has written them (map, copy, unmap).
        ``index``: the submission that wrote them (from :meth:`submit_encoded`): only that
        one is waited for, not the ones submitted after it (wgpu-native)."""
        n = sum(sizes)
        if self._native is not None:
            raw = self._native.read(staging, 4 * n, index).view(np.float32)
        else:
            staging.map_sync(self.wgpu.MapMode.READ)
            raw = np.frombuffer(staging.read_mapped(copy=False), np.float32, n).copy()
            staging.unmap()
        out, off = [], 0
        for n in sizes:
            out.append(raw[off:off + n])
            off += n
        return out

    def read_start(self, buf, ranges, stagings):
        """Queue copies of the float32 ranges ``(lo, hi)`` of ``buf`` into the
        MAP_READ buffers ``stagings`` (one each, see :meth:`staging`) after everything
        submitted so far; returns at once. Then :meth:`map_read` each, :meth:`wait_for`
        it, :meth:`copy_mapped`, and unmap it.

        While a map is pending, wgpu-py's poller thread waits on the device for the
        last submission (``wgpuDevicePoll(wait=True)``), which holds up every later
        submit, write or unmap of the device until then (measured on an H200: a submit
        held 143 ms); callers that must go on meanwhile map from another thread."""
        enc = self.device.create_command_encoder()
        for (lo, hi), st in zip(ranges, stagings):
            enc.copy_buffer_to_buffer(buf, 4 * lo, st, 0, 4 * (hi - lo))
        self.device.queue.submit([enc.finish()])

    def map_read(self, staging):
        """Start mapping a staging buffer for reading; returns the promise."""
        return staging.map_async(self.wgpu.MapMode.READ, 0, staging.size)

    def wait_for(self, promise, idle=None):
        """Wait for ``promise``; ``idle``: called every 0.2 ms meanwhile (e.g. to let MPI
        progress), where the backend lets us wait in slices (a thread of its own resolves
        the promise: wgpu-native); else (Dawn) once before the blocking wait, which alone
        runs the callback that resolves it."""
        event = getattr(promise, "_thread_event", None)   # wgpu-native: set by its poller
        if idle is not None and event is not None and self.backend.POLLED_MAPS:
            while not event.wait(2e-4):
                idle()
        elif idle is not None:
            idle()
        promise.sync_wait()

    @staticmethod
    def copy_mapped(staging, out):
        """``out`` (float32, its size) = the mapped staging buffer's first elements."""
        out[:] = np.frombuffer(staging.read_mapped(copy=False), np.float32, out.size)

    def staging(self, n_floats, name):
        """A host-readable buffer (MAP_READ) of ``n_floats`` for :meth:`read_start` and
        :meth:`read_many`."""
        w = self.wgpu
        return self.device.create_buffer(label=name, size=4 * max(n_floats, 1),
                                         usage=w.BufferUsage.COPY_DST | w.BufferUsage.MAP_READ)

    def read(self, buf, n: int, dtype=np.float32, offset: int = 0) -> np.ndarray:
        """Copy ``n`` elements starting at element ``offset`` back to the host."""
        if n == 0:
            return np.zeros(0, dtype)
        size = np.dtype(dtype).itemsize
        raw = self.device.queue.read_buffer(buf, offset * size, n * size)
        return np.frombuffer(raw, dtype=dtype, count=n).copy()

    # ----------------------------------------------------------- dispatches
    def grid1d(self, n_groups: int, what: str):
        """Workgroup grid (x, y) for ``n_groups`` groups, split in y when x would
        pass max_compute_workgroups_per_dimension (kernels use flat_index)."""
        n_groups = max(int(n_groups), 1)
        if n_groups <= self.max_groups:
            return (n_groups, 1, 1)
        y = math.ceil(n_groups / self.max_groups)
        if y > self.max_groups:
            raise ValueError(f"mamba_ext.gpu: {what} needs {n_groups} workgroups, more than "
                             f"max_compute_workgroups_per_dimension^2 = {self.max_groups ** 2}")
        return (math.ceil(n_groups / y), y, 1)

    def check_grid(self, grid, what: str):
        for g in grid:
            if g > self.max_groups:
                raise ValueError(f"mamba_ext.gpu: {what} needs a grid of {tuple(grid)} workgroups; "
                                 f"this adapter's max_compute_workgroups_per_dimension is "
                                 f"{self.max_groups}; use a smaller batch or model")
        return tuple(int(g) for g in grid)

    def op(self, file, entry, grid, params, buffers, constants=None, prelude: str = "") -> Op:
        """Record a dispatch: binding 0 = uniform ``params``, 1.. = ``buffers`` (a buffer,
        a :class:`Slice` of one, or None = a binding this entry point does not use)."""
        pl = self.pipeline(file, entry, constants, prelude)
        ubuf = self.uniform(params)
        entries = [{"binding": 0, "resource": {"buffer": ubuf}}]
        for i, b in enumerate(buffers, start=1):
            if b is None:
                continue
            if isinstance(b, Slice):
                res = {"buffer": b.buffer, "offset": b.offset, "size": b.size}
            else:
                res = {"buffer": b, "offset": 0, "size": b.size}
            entries.append({"binding": i, "resource": res})
        check_aliasing(file, entry, [(e["binding"], e["resource"]["buffer"],
                                      e["resource"]["offset"], e["resource"]["size"])
                                     for e in entries[1:]])
        bg = self.device.create_bind_group(layout=pl.get_bind_group_layout(0), entries=entries)
        return Op(pl, bg, self.check_grid(grid, f"{file}.{entry}"), entry, ubuf)

    def write_params(self, op: Op, values):
        """Replace the uniform parameters of a recorded op (same layout)."""
        words = b"".join(struct.pack("<f", v) if isinstance(v, float) else struct.pack("<I", int(v))
                         for v in values)
        self.device.queue.write_buffer(op.params, 0, words)

    def submit(self, ops, clears=(), timestamps=None):
        """Clear ``clears``, then run ``ops`` in order. ``timestamps`` = (query_set,
        resolve buffer): all ops in ONE compute pass whose start and end are
        recorded (the benches). Otherwise the ops go in command buffers of
        SUBMIT_FIRST, then twice as many, ... up to SUBMIT_MAX dispatches, each
        submitted as soon as it is encoded: the GPU runs the first while Python
        encodes the rest (a training step of 166 dispatches otherwise waits
        about 2.7 ms for its encoding on an H200 host)."""
        if timestamps is not None:
            enc = self._encoder(clears)
            tw = {"query_set": timestamps[0], "beginning_of_pass_write_index": 0,
                  "end_of_pass_write_index": 1}
            self._encode(enc.begin_compute_pass(timestamp_writes=tw), ops)
            enc.resolve_query_set(timestamps[0], 0, 2, timestamps[1], 0)
            self.device.queue.submit([enc.finish()])
            return
        i, n = 0, SUBMIT_FIRST
        while True:
            enc = self._encoder(clears if i == 0 else ())
            self._encode(enc.begin_compute_pass(), ops[i:i + n])
            self.device.queue.submit([enc.finish()])
            i, n = i + n, min(2 * n, SUBMIT_MAX)
            if i >= len(ops):
                return

    def encode(self, ops, clears=(), reads=None):
        """``ops`` (after clearing ``clears``) recorded into one command buffer for a later
        :meth:`submit_encoded`; ``reads`` = (staging, parts): then copy each (buffer, n) of
        parts into the MAP_READ buffer ``staging`` (:meth:`staging`), for
        :meth:`read_staged`. Encoding costs the host 5-10 us per dispatch (wgpu's
        validation and the driver's recording; 12-14 us through wgpu-py's methods, see
        _native_dispatch): over 1 ms for the 166 dispatches of a 4 x 256 training step on
        the H200 host, 10-20% of its GPU time, so a caller that runs the same ops again
        encodes the next run while the GPU works on this one."""
        enc = self._encoder(clears)
        self._encode(enc.begin_compute_pass(), ops)
        if reads is not None:
            self._copy_out(enc, *reads)
        return enc.finish()

    def submit_encoded(self, command_buffer):
        """Run a command buffer of :meth:`encode` (once; buffer writes queued before this
        call are seen by it). Returns its submission index for :meth:`read_staged`
        (None where the backend does not give one)."""
        if self._native is not None:
            return self._native.submit(command_buffer)
        self.device.queue.submit([command_buffer])
        return None

    def run_ahead(self, ops, clears, reads, ready=None, ahead=True):
        """Run ``ops`` (after clearing ``clears``) and read back ``reads`` = (staging,
        parts) (see :meth:`encode`). ``ready``: the command buffer the previous call
        encoded for this run, else it is encoded now. With ``ahead``, the next run's is
        encoded while the GPU works on this one (the same ops: only buffer contents may
        change between runs, written before the next call). Returns (that command buffer
        or None, the float32 arrays of parts)."""
        index = self.submit_encoded(ready if ready is not None else self.encode(ops, clears, reads))
        nxt = self.encode(ops, clears, reads) if ahead else None
        return nxt, self.read_staged(reads[0], [n for _, n in reads[1]], index)

    def _encoder(self, clears):
        enc = self.device.create_command_encoder()
        for buf in clears:
            enc.clear_buffer(buf)
        return enc

    def _encode(self, cp, ops):
        if self._record is not None and hasattr(cp, "_internal"):
            self._record(cp, ops)
        else:
            for op in ops:
                cp.set_pipeline(op.pipeline)
                cp.set_bind_group(0, op.bind_group)
                cp.dispatch_workgroups(*op.grid)
        cp.end()

    def timestamp_pair(self):
        """(query_set, resolve buffer) for :meth:`submit`, or None without the feature."""
        if not self.timestamps:
            return None
        w = self.wgpu
        qs = self.device.create_query_set(type=w.QueryType.timestamp, count=2)
        buf = self.device.create_buffer(size=16, usage=w.BufferUsage.QUERY_RESOLVE
                                        | w.BufferUsage.COPY_SRC)
        return qs, buf

    def scratch(self, name, n_floats):
        """A device-wide scratch buffer ``name`` of at least ``n_floats`` (reused by
        every op recorded later; dispatches of one pass run in order, so ops that
        use it one after the other never overlap). Grows by replacement: ops
        recorded earlier keep the smaller buffer they were bound to."""
        cache = self.__dict__.setdefault("_scratch", {})
        buf = cache.get(name)
        if buf is None or buf.size < 4 * n_floats:
            buf = cache[name] = self.buffer(max(n_floats, 4), name)
        return buf

    def dummy(self, k=0):
        """The k-th tiny placeholder buffer, for bindings that an entry point declares but
        does not use in this configuration (bound so that every binding of the "auto"
        layout has a buffer). Writable bindings of one dispatch each take their own k:
        WebGPU forbids one buffer behind two writable bindings (check_aliasing)."""
        d = self.__dict__.setdefault("_dummies", {})
        if k not in d:
            d[k] = self.buffer(4, f"unused{k}")
        return d[k]

    def sync(self):
        """Wait until all submitted work is done: read back a tiny buffer (the
        copy is queued after everything submitted before; wgpu-py 0.32's
        on_submitted_work_done_sync is broken)."""
        if getattr(self, "_sync_buf", None) is None:
            self._sync_buf = self.buffer(4, "sync")
        self.read(self._sync_buf, 1)


EW_WG = 256        # elementwise kernels' workgroup size (override constant WG)


def elementwise(g, file, entry, n, params, buffers, wg=EW_WG, constants=None, prelude=""):
    """Op with one invocation per element of an ``n``-element problem."""
    return g.op(file, entry, g.grid1d(math.ceil(n / wg), f"{file}.{entry}"), params, buffers,
                {"WG": wg, **(constants or {})}, prelude)


COLUMN_SUM_ROWS = 256      # rows per block of column_sum's first pass (at least)
COLUMN_SUM_BLOCKS = 64     # row blocks at most


def column_sum(g, M, C, a, a_off, a_rs, out, o_off, b=None, b_off=0, b_rs=0):
    """Ops for out[o_off + j] += sum_r a[a_off + r*a_rs + j] (* b[b_off + r*b_rs + j]),
    r < M, j < C (kernels/reduce.wgsl): the gain and D_vec gradients. Two passes
    (row blocks, then their fixed-order sum, :func:`column_sum_final`) through a scratch
    buffer of the device (:func:`column_sum_part`)."""
    RB = max(1, min(COLUMN_SUM_BLOCKS, math.ceil(M / COLUMN_SUM_ROWS)))
    rows_per = math.ceil(max(M, 1) / RB)
    params = [M, C, a_off, a_rs, b_off, b_rs, o_off, 0 if b is None else 1, rows_per, RB]
    part = column_sum_part(g, RB, C)
    return [g.op("reduce", "column_sum", g.check_grid((math.ceil(C / 32), RB, 1), "column_sum"),
                 params, [a, a if b is None else b, part, out]),
            column_sum_final(g, C, RB, part, out, o_off, a)]


def column_sum_part(g, RB, C):
    """The device's scratch buffer of column partial sums, (RB, C) f32: column_sum's row
    blocks, or the tiles of linear_f16.pack_pair_bias."""
    return g.scratch("column_sum", RB * C)


def column_sum_final(g, C, RB, part, out, o_off, read):
    """Op: out[o_off + j] += the sum of part[rb, j] over rb = 0 .. RB-1, j < C, in a fixed
    order (kernels/reduce.wgsl's second pass: 8 lanes of every 8th row block, then the
    lanes in order). ``read``: any buffer, for the entry's read-only bindings it does not
    use."""
    params = [0, C, 0, 0, 0, 0, o_off, 0, 0, RB]      # reduce.wgsl's Params: C, o_off, RB
    return g.op("reduce", "column_sum_final", g.check_grid((math.ceil(C / 32), 1, 1),
                                                           "column_sum_final"),
                params, [read, read, part, out])


def arena_layout(names_shapes):
    """Offsets of tensors packed one after the other: ({name: offset}, total)."""
    offs, total = {}, 0
    for name, shape in names_shapes:
        offs[name] = total
        total += math.prod(shape)
    return offs, total


def _adapters(wgpu):
    """The adapters that count for MAMBA_EXT_GPU_INDEX, in wgpu's order: those of
    the native backends (Vulkan, Metal, D3D12) that are not software renderers,
    falling back to the software ones, then to all."""
    found = list(wgpu.gpu.enumerate_adapters_sync())
    native = [a for a in found if str(a.info.get("backend_type", "")) not in ("OpenGL", "GL")] or found
    # real GPUs first: a software adapter (llvmpipe) counts only when there is no other
    real = [a for a in native if str(a.info.get("adapter_type", "")).lower() != "cpu"]
    return real or native


def adapter_count() -> int:
    """Number of adapters MAMBA_EXT_GPU_INDEX chooses from (0 without the backend's
    package: wgpu, or wgpudawn for MAMBA_EXT_GPU_BACKEND=dawn)."""
    from . import backends
    try:
        be = backends.load()
        wgpu = be.module()
    except (ImportError, RuntimeError):
        return 0
    be.prepare(_shader_checks())
    return len(_adapters(wgpu))


def _adapter_choice() -> str:
    """use_adapter()'s index, else MAMBA_EXT_GPU_INDEX ("" when neither is set)."""
    return (str(_ADAPTER_INDEX) if _ADAPTER_INDEX is not None
            else os.environ.get("MAMBA_EXT_GPU_INDEX", "").strip())


def open_adapter(wgpu):
    """The adapter of the wgpu-py API module ``wgpu`` that the device opens: the one
    :func:`_adapter_choice` names, else the high-performance one (None: none found)."""
    index = _adapter_choice()
    if index:
        return _adapter_by_index(wgpu, index)
    return wgpu.gpu.request_adapter_sync(power_preference="high-performance")


def _adapter_by_index(wgpu, index: str):
    adapters = _adapters(wgpu)
    if not index.isdigit() or int(index) >= len(adapters):
        raise RuntimeError(f"MAMBA_EXT_GPU_INDEX={index!r}: expected an adapter index in "
                           f"[0, {len(adapters)}); adapters found: "
                           f"{[a.info.get('device') for a in adapters]}")
    return adapters[int(index)]


_GPU = None
_LOCK = threading.Lock()
_ADAPTER_INDEX = None       # use_adapter()'s choice, before MAMBA_EXT_GPU_INDEX


def use_adapter(index: int) -> None:
    """Open adapter ``index`` (counted as for MAMBA_EXT_GPU_INDEX) when :func:`gpu` creates
    the process's device: a launcher's per-rank choice, made without changing the
    environment. Refused (RuntimeError) once the device is open on another adapter."""
    global _ADAPTER_INDEX
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index: expected an adapter index >= 0, got {index!r}")
    with _LOCK:
        if _GPU is not None and _GPU.adapter_index != index:
            raise RuntimeError(f"mamba_ext.gpu: the device is already open on adapter "
                               f"{_GPU.adapter_index}; use_adapter({index}) must come first")
        _ADAPTER_INDEX = index


def gpu() -> Gpu:
    """The process-wide device (created on first use)."""
    global _GPU
    if _GPU is None:
        with _LOCK:
            if _GPU is None:
                _GPU = Gpu()
    return _GPU


def available() -> bool:
    """True when wgpu is installed and finds an adapter."""
    try:
        gpu()
        return True
    except RuntimeError:
        return False
