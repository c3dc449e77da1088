"""safetensors files, written and verified by mamba_ext itself (no dependency).

Layout (https://github.com/huggingface/safetensors): 8-byte little-endian
header length ``n``, ``n`` bytes of JSON header (padded with spaces to a
multiple of 8), then the raw little-endian tensor data. The header maps each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data section) and ``__metadata__`` to a str -> str dict.

Writes are atomic: a temporary file in the target folder is written, flushed
and fsync'ed, then ``os.replace``d over the target (and the folder fsync'ed),
so a crash leaves either the old file or the new one, never a mix.
We store ``sha256`` of the data section in ``__metadata__["mamba_ext.sha256"]``;
:func:`load` verifies the header, every dtype/shape/offset, the file size and
that checksum, and refuses a truncated or corrupted file with ``ValueError``.

Training checkpoints (:func:`save_checkpoint` / :func:`load_checkpoint`) use
tensor names ``param.<name>`` and ``optim.<key>`` and JSON in the metadata for
the step, the config and the optimizer/scaler scalars.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import IO, Any

import numpy as np
from numpy.typing import ArrayLike

StrPath = str | os.PathLike[str]     # a file path, as open() takes it

CHECKSUM_KEY = "mamba_ext.sha256"
_MAX_HEADER = 100 * 1024 * 1024

# safetensors dtype code <-> numpy dtype (little-endian)
_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_CODES = {dt: code for code, dt in _DTYPES.items()}


def _code(name: str, a: np.ndarray) -> str:
    code = _CODES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
    if code is None:
        raise TypeError(f"{name}: dtype {a.dtype} cannot be stored in safetensors "
                        f"(supported: {sorted(_CODES.values())})")
    return code


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # e.g. platforms without directory fds
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(path: StrPath, tensors: Mapping[str, ArrayLike], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (name -> array) and ``metadata`` (str -> str) atomically."""
    path = os.fspath(path)
    meta = {} if metadata is None else dict(metadata)
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata: keys and values must be str, got {k!r}: {type(v).__name__}")
    arrays, header, offset = [], {}, 0
    for name in tensors:
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensors: invalid tensor name {name!r}")
        a = np.asarray(tensors[name])
        code = _code(name, a)
        a = np.asarray(a, dtype=_DTYPES[code], order="C")  # keeps 0-d shapes
        header[name] = {"dtype": code, "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.reshape(-1).view(np.uint8))
    meta[CHECKSUM_KEY] = h.hexdigest()
    header["__metadata__"] = meta
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)

    def write(f):
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8))

    atomic_write(path, write)


def atomic_write(path: StrPath, write: Callable[[IO[bytes]], Any]) -> None:
    """Create/replace ``path`` atomically: ``write(f)`` fills a temporary file in
    the same folder, which is fsync'ed and then ``os.replace``d over ``path``."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)


def load(path: StrPath, require_checksum: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a safetensors file; returns ``(tensors, metadata)``.

    Every check failure raises ``ValueError`` naming the file and the problem.
    ``require_checksum=False`` accepts files written by other tools (no
    ``mamba_ext.sha256`` in the metadata); a checksum that is present is
    always verified.
    """
    path = os.fspath(path)

    def bad(why):
        return ValueError(f"{path}: not a valid safetensors checkpoint: {why}")

    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise bad(f"file is {len(raw)} bytes, shorter than the 8-byte header length (truncated?)")
    n = int.from_bytes(raw[:8], "little")
    if n < 2 or n > _MAX_HEADER or 8 + n > len(raw):
        raise bad(f"header length {n} does not fit the file size {len(raw)} (truncated or corrupted)")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise bad("__metadata__ must map str to str")
    data = memoryview(raw)[8 + n:]

    entries = []
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
        dt = _DTYPES.get(e["dtype"])
        if dt is None:
            raise bad(f"tensor {name!r}: unsupported dtype {e['dtype']!r}")
        shape, offs = e["shape"], e["data_offsets"]
        if (not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)):
            raise bad(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offs) or offs[0] > offs[1]):
            raise bad(f"tensor {name!r}: data_offsets {offs!r} invalid")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if offs[1] - offs[0] != nbytes:
            raise bad(f"tensor {name!r}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, "
                      f"but dtype {e['dtype']} shape {shape} needs {nbytes}")
        entries.append((offs[0], offs[1], name, dt, tuple(shape)))
    entries.sort()
    pos = 0
    for begin, end, name, _, _ in entries:
        if begin != pos:
            raise bad(f"tensor {name!r}: data starts at {begin}, expected {pos} "
                      f"(overlapping tensors or a hole in the data)")
        pos = end
    if pos != len(data):
        raise bad(f"data section is {len(data)} bytes but the header describes {pos} "
                  f"(truncated or trailing garbage)")

    digest = meta.get(CHECKSUM_KEY)
    if digest is None:
        if require_checksum:
            raise bad(f"no {CHECKSUM_KEY} checksum in __metadata__ (not written by mamba_ext)")
    else:
        h = hashlib.sha256()
        for begin, end, *_ in entries:     # checksum covers the data in offset order
            h.update(data[begin:end])
        if h.hexdigest() != digest:
            raise bad("sha256 checksum mismatch: the tensor data is corrupted")

    where = {name: (begin, end, dt, shape) for begin, end, name, dt, shape in entries}
    tensors = {}
    for name in header:                    # the file's order
        begin, end, dt, shape = where[name]
        a = np.frombuffer(data[begin:end], dtype=dt).reshape(shape)
        tensors[name] = a.astype(dt.newbyteorder("="), copy=True)
    return tensors, meta


# -- training checkpoints ----------------------------------------------------

def _flatten(prefix: str, obj, tensors: dict, scalars: dict) -> None:
    # nested dicts -> "a/b/c" keys; arrays become tensors, the rest JSON scalars
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, tensors, scalars)
    elif isinstance(obj, np.ndarray):
        tensors[prefix] = obj
    else:
        scalars[prefix] = obj


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        *path, last = key.split("/")
        d = out
        for p in path:
            d = d.setdefault(p, {})
        d[last] = v
    return out


def save_checkpoint(path: StrPath, params: Mapping[str, ArrayLike], *, step: int,
                    config: Mapping[str, Any], optimizer_state: Mapping[str, Any] | None = None,
                    extra: Mapping[str, Any] | None = None,
                    arrays: Mapping[str, ArrayLike] | None = None) -> None:
    """A training checkpoint: ``params`` (name -> array), the optimizer's
    ``state_dict()`` (possibly nested dicts; arrays stored as tensors
    ``optim.<a/b>``, everything else as JSON), ``step``, ``config`` and
    ``extra`` (JSON-able, e.g. loss-scaler state), ``arrays`` (name -> array,
    e.g. the loss history)."""
    tensors = {f"param.{k}": v for k, v in params.items()}
    opt_t, opt_s = {}, {}
    _flatten("", optimizer_state or {}, opt_t, opt_s)
    tensors.update({f"optim.{k}": v for k, v in opt_t.items()})
    tensors.update({f"array.{k}": v for k, v in (arrays or {}).items()})
    meta = {
        "format": "mamba_ext.training.loop/1",
        "step": str(int(step)),
        "config": json.dumps(config, sort_keys=True),
        "optimizer": json.dumps(opt_s, sort_keys=True, default=_json_default),
        "extra": json.dumps(extra or {}, sort_keys=True, default=_json_default),
    }
    save(path, tensors, meta)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, (tuple, set, frozenset)):
        return sorted(o) if isinstance(o, (set, frozenset)) else list(o)
    raise TypeError(f"checkpoint: cannot store {type(o).__name__} in the metadata")


def load_checkpoint(path: StrPath) -> dict[str, Any]:
    """Inverse of :func:`save_checkpoint`: a dict with ``params``, ``step``,
    ``config``, ``optimizer_state``, ``extra``, ``arrays``. (Tuples stored in the
    optimizer state come back as lists.)"""
    tensors, meta = load(path, require_checksum=True)
    if meta.get("format") != "mamba_ext.training.loop/1":
        raise ValueError(f"{os.fspath(path)}: not a mamba_ext training checkpoint "
                         f"(format {meta.get('format')!r})")
    try:
        step = int(meta["step"])
        config = json.loads(meta["config"])
        opt_flat = json.loads(meta["optimizer"])
        extra = json.loads(meta["extra"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"{os.fspath(path)}: checkpoint metadata incomplete or invalid ({e})") from None
    out = {"params": {}, "arrays": {}, "step": step, "config": config, "extra": extra}
    for name, a in tensors.items():
        kind, _, key = name.partition(".")
        if kind == "param":
            out["params"][key] = a
        elif kind == "optim":
            opt_flat[key] = a
        elif kind == "array":
            out["arrays"][key] = a
    out["optimizer_state"] = _unflatten(opt_flat)
    return out
