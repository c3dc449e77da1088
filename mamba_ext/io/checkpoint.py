"""safetensors files, written and verified by mamba_ext itself (no dependency).

Layout (https://github.com/huggingface/safetensors): 8-byte little-endian
header length ``n``, ``n`` bytes of JSON header (padded with spaces to a
multiple of 8), then the raw little-endian tensor data. The header maps each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data section) and ``__metadata__`` to a str -> str dict.

Writes are atomic: a temporary file in the target folder is written, flushed
and fsync'ed, then ``os.replace``d over the target (and the folder fsync'ed),
so a crash leaves either the old file or the new one, never a mix. The file gets
the permissions a plain ``open(path, "w")`` would give it (0666 minus the umask).

Integrity: ``__metadata__["mamba_ext.file_sha256"]`` holds the sha256 of the WHOLE
file (length prefix, header, metadata and tensor data) computed with the digest's 64
hex digits set to ``0``; so every byte is authenticated, the header included.
:func:`load` checks the structure (every field of every entry, the file size), then
the digest, and refuses a truncated or corrupted file with one ``ValueError`` that
names the file and the field.

Training checkpoints (:func:`save_checkpoint` / :func:`load_checkpoint`) use
tensor names ``param.<name>``, ``optim.<key>`` and ``array.<name>`` and JSON in the
metadata for the step, the config and the optimizer/scaler scalars; every tensor
name and metadata key is checked (unknown ones are refused).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from typing import IO, Any

import numpy as np
from numpy.typing import ArrayLike

from .files import read_regular

StrPath = str | os.PathLike[str]     # a file path, as open() takes it

CHECKSUM_KEY = "mamba_ext.file_sha256"
# Files of mamba_ext <= 0.1 carried a sha256 of the tensor data only, under this key.
LEGACY_CHECKSUM_KEY = "mamba_ext.sha256"
_DIGEST_HEX = 64
_PLACEHOLDER = "0" * _DIGEST_HEX
_MAX_HEADER = 100 * 1024 * 1024
_MAX_RANK = 64

# safetensors dtype code <-> numpy dtype (little-endian)
_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
# bfloat16 has no NumPy dtype: its 16-bit patterns are held in this one-field structured
# dtype (2 bytes, a type of its own, so it never mixes with uint16 data). load() returns BF16
# tensors up-cast to float32 (exact: a bfloat16 is the top half of a float32);
# to_bfloat16() makes such an array for save().
BF16 = np.dtype([("bf16", "<u2")])
_DTYPES["BF16"] = BF16
_CODES = {dt: code for code, dt in _DTYPES.items()}
FLOAT_CODES = ("F16", "BF16", "F32", "F64")


def to_bfloat16(a: ArrayLike) -> np.ndarray:
    """Float array -> array of dtype :data:`BF16` (for :func:`save`): each value rounded to
    the nearest bfloat16, ties to even, from its float32 rounding; NaN stays NaN, values past
    the bfloat16 range become +-Inf (as torch's ``.to(torch.bfloat16)``)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)   # round half to even
    top = (rounded >> 16).astype(np.uint16)
    top[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)          # a quiet NaN
    return top.view(BF16)


def from_bfloat16(a: np.ndarray) -> np.ndarray:
    """Array of dtype :data:`BF16` -> float32, exactly."""
    u16 = np.ascontiguousarray(a).view("<u2").astype(np.uint32)
    return (u16 << 16).view(np.float32)


def _code(name: str, a: np.ndarray) -> str:
    code = _CODES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
    if code is None:
        raise TypeError(f"{name}: dtype {a.dtype} cannot be stored in safetensors "
                        f"(supported: {sorted(_CODES.values())})")
    return code


def strict_json(text: str, what: str) -> Any:
    """``json.loads`` that refuses duplicate keys and the non-standard NaN/Infinity
    constants (a flipped byte must not turn into a silently different value)."""
    def pairs(items):
        d = {}
        for k, v in items:
            if k in d:
                raise ValueError(f"{what}: duplicate key {k!r}")
            d[k] = v
        return d

    def constant(c):
        raise ValueError(f"{what}: non-finite number {c} is not valid JSON")

    return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)


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
    """Write ``tensors`` (name -> array) and ``metadata`` (str -> str) atomically,
    with the whole-file digest (see the module docstring)."""
    path = os.fspath(path)
    meta = {} if metadata is None else dict(metadata)
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata: keys and values must be str, got {k!r}: {type(v).__name__}")
    if CHECKSUM_KEY in meta or LEGACY_CHECKSUM_KEY in meta:
        raise ValueError(f"metadata: {CHECKSUM_KEY!r} and {LEGACY_CHECKSUM_KEY!r} are written by save itself")
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
    meta[CHECKSUM_KEY] = _PLACEHOLDER
    header["__metadata__"] = meta
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    field = _digest_field(_PLACEHOLDER)
    assert hb.count(field) == 1        # our key, written once by json.dumps
    prefix = len(hb).to_bytes(8, "little")
    h = hashlib.sha256(prefix)
    h.update(hb)
    for a in arrays:
        h.update(a.reshape(-1).view(np.uint8))
    hb = hb.replace(field, _digest_field(h.hexdigest()))

    def write(f):
        f.write(prefix)
        f.write(hb)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8))

    atomic_write(path, write)


def _digest_field(hexdigest: str) -> bytes:
    return f'"{CHECKSUM_KEY}":"{hexdigest}"'.encode("ascii")


def _umask() -> int:
    """The process umask, read without changing it where the system says it
    (Linux: /proc/self/status); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: StrPath, write: Callable[[IO[bytes]], Any]) -> None:
    """Create/replace ``path`` atomically: ``write(f)`` fills a temporary file in
    the same folder, which is fsync'ed and then ``os.replace``d over ``path``.
    The file gets mode 0666 minus the umask (what ``open(path, "w")`` gives), not the
    0600 of a temporary file. The temporary file is named ``.<name>.<random>.tmp``;
    :func:`remove_stale_temporaries` removes those a killed process left behind."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), 0o666 & ~_umask())
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


def remove_stale_temporaries(folder: StrPath, name: str) -> list[str]:
    """Remove the ``.<name>.*.tmp`` files that :func:`atomic_write` of ``folder/name``
    leaves when its process is killed mid-write; returns the paths removed. Call it only
    where no other process is writing ``name`` in ``folder`` (e.g. at the start of a run
    that owns the folder)."""
    folder = os.fspath(folder)
    pattern = re.compile(re.escape("." + name + ".") + r"[A-Za-z0-9_]+\.tmp\Z")
    removed = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        full = os.path.join(folder, entry)
        if pattern.match(entry) and os.path.isfile(full) and not os.path.islink(full):
            try:
                os.unlink(full)
                removed.append(full)
            except OSError:
                pass
    return removed


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def load(path: StrPath, require_checksum: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a safetensors file; returns ``(tensors, metadata)`` (the digest key removed).

    Every check failure raises ``ValueError`` naming the file, the tensor and the field.
    ``require_checksum=False`` accepts files written by other tools (no digest in the
    metadata), whose bytes nothing authenticates; a digest that is present is always
    verified. Files of mamba_ext <= 0.1 (tensor data checksum only) are refused unless
    ``require_checksum=False`` (then their data checksum is verified).
    """
    path = os.fspath(path)

    def bad(why):
        return ValueError(f"{path}: not a valid safetensors checkpoint: {why}")

    raw = read_regular(path, "a checkpoint")
    if len(raw) < 8:
        raise bad(f"file is {len(raw)} bytes, shorter than the 8-byte header length (truncated?)")
    n = int.from_bytes(raw[:8], "little")
    if n < 2 or n > _MAX_HEADER or 8 + n > len(raw):
        raise bad(f"header length {n} does not fit the file size {len(raw)} (truncated or corrupted)")
    header_bytes = raw[8:8 + n]
    try:
        header = strict_json(header_bytes.decode("utf-8"), "header")
    except (UnicodeDecodeError, ValueError) as e:     # JSONDecodeError is a ValueError
        raise bad(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("field '__metadata__' must map str to str")
    data = memoryview(raw)[8 + n:]

    entries = []
    for name, e in header.items():
        where = f"tensor {name!r}"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"{where}: entry must have exactly the fields dtype, shape, data_offsets")
        code, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(code, str) or code not in _DTYPES:
            raise bad(f"{where}: field 'dtype': {code!r} is not one of {sorted(_DTYPES)}")
        dt = _DTYPES[code]
        if not _int_list(shape) or len(shape) > _MAX_RANK or any(s < 0 for s in shape):
            raise bad(f"{where}: field 'shape': {shape!r} is not a list of at most {_MAX_RANK} "
                      f"non-negative integers")
        if not _int_list(offs) or len(offs) != 2 or not 0 <= offs[0] <= offs[1] <= len(data):
            raise bad(f"{where}: field 'data_offsets': {offs!r} is not [begin, end] with "
                      f"0 <= begin <= end <= {len(data)}, the data section's size (truncated or corrupted)")
        count = 1
        for s in shape:            # Python integers: a shape of [2**70] cannot wrap around
            count *= s
        nbytes = count * dt.itemsize
        if offs[1] - offs[0] != nbytes:
            raise bad(f"{where}: field 'data_offsets': {offs} hold {offs[1] - offs[0]} bytes, "
                      f"but dtype {code} and shape {shape} need {nbytes}")
        entries.append((offs[0], offs[1], name, dt, tuple(shape)))
    entries.sort()
    pos = 0
    for begin, end, name, _, _ in entries:
        if begin != pos:
            raise bad(f"tensor {name!r}: field 'data_offsets': data starts at {begin}, expected {pos} "
                      f"(overlapping tensors or a hole in the data)")
        pos = end
    if pos != len(data):
        raise bad(f"data section is {len(data)} bytes but the header describes {pos} "
                  f"(truncated or trailing garbage)")

    digest = meta.pop(CHECKSUM_KEY, None)
    legacy = meta.pop(LEGACY_CHECKSUM_KEY, None)
    if digest is not None:
        if not (len(digest) == _DIGEST_HEX and re.fullmatch(r"[0-9a-f]+", digest)):
            raise bad(f"field '__metadata__.{CHECKSUM_KEY}': {digest!r} is not a sha256 hex digest")
        field = _digest_field(digest)
        if header_bytes.count(field) != 1:
            raise bad(f"field '__metadata__.{CHECKSUM_KEY}' is not written as mamba_ext writes it")
        h = hashlib.sha256(raw[:8])
        h.update(header_bytes.replace(field, _digest_field(_PLACEHOLDER)))
        h.update(data)
        if not hmac.compare_digest(h.hexdigest(), digest):
            raise bad("sha256 checksum mismatch: the file is corrupted (its digest covers every "
                      "byte: header, metadata and tensor data)")
    elif require_checksum:
        if legacy is not None:
            raise bad(f"written by mamba_ext <= 0.1, whose checksum ({LEGACY_CHECKSUM_KEY}) covers "
                      f"the tensor data only, not the header; load it with require_checksum=False "
                      f"and save it again")
        raise bad(f"no {CHECKSUM_KEY} digest in __metadata__ (not written by mamba_ext)")
    elif legacy is not None:
        h = hashlib.sha256()
        for begin, end, *_ in entries:     # the legacy checksum covers the data in offset order
            h.update(data[begin:end])
        if not hmac.compare_digest(h.hexdigest(), str(legacy)):
            raise bad("sha256 checksum mismatch: the tensor data is corrupted")

    where = {name: (begin, end, dt, shape) for begin, end, name, dt, shape in entries}
    tensors = {}
    for name in header:                    # the file's order
        begin, end, dt, shape = where[name]
        a = np.frombuffer(data[begin:end], dtype=dt).reshape(shape)
        tensors[name] = from_bfloat16(a) if dt == BF16 else a.astype(dt.newbyteorder("="), copy=True)
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
        "format": _FORMAT,
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


_META_KEYS = {"format", "step", "config", "optimizer", "extra"}
_FORMAT = "mamba_ext.training.loop/1"


def load_checkpoint(path: StrPath) -> dict[str, Any]:
    """Inverse of :func:`save_checkpoint`: a dict with ``params``, ``step``,
    ``config``, ``optimizer_state``, ``extra``, ``arrays``. (Tuples stored in the
    optimizer state come back as lists.)

    Strict: the digest must be there and match, the metadata must hold exactly the keys
    save_checkpoint writes (``step`` in canonical ASCII decimal, JSON without duplicate
    keys or NaN), and every tensor name must be ``param.<name>``, ``optim.<key>`` or
    ``array.<name>``. Checking the contents against a model is the caller's
    (``mamba_ext.training.loop.load_training_checkpoint``).
    """
    fname = os.fspath(path)
    tensors, meta = load(path, require_checksum=True)
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{fname}: not a mamba_ext training checkpoint "
                         f"(field '__metadata__.format' is {meta.get('format')!r})")
    if set(meta) != _META_KEYS:
        raise ValueError(f"{fname}: field '__metadata__': keys {sorted(meta)}, expected {sorted(_META_KEYS)}")
    if not re.fullmatch(r"0|[1-9][0-9]{0,17}", meta["step"], re.ASCII):
        raise ValueError(f"{fname}: field '__metadata__.step': {meta['step']!r} is not a step number")
    step = int(meta["step"])
    parsed = {}
    for key in ("config", "optimizer", "extra"):
        try:
            parsed[key] = strict_json(meta[key], f"__metadata__.{key}")
        except ValueError as e:
            raise ValueError(f"{fname}: field '__metadata__.{key}' is not valid JSON ({e})") from None
        if not isinstance(parsed[key], dict):
            raise ValueError(f"{fname}: field '__metadata__.{key}' is not a JSON object")
    opt_flat = parsed["optimizer"]
    out = {"params": {}, "arrays": {}, "step": step, "config": parsed["config"],
           "extra": parsed["extra"]}
    for name, a in tensors.items():
        kind, dot, key = name.partition(".")
        if not dot or not key:
            kind = ""
        if kind == "param":
            out["params"][key] = a
        elif kind == "optim":
            if key in opt_flat:
                raise ValueError(f"{fname}: tensor {name!r}: also stored as a scalar in "
                                 f"'__metadata__.optimizer'")
            opt_flat[key] = a
        elif kind == "array":
            out["arrays"][key] = a
        else:
            raise ValueError(f"{fname}: tensor {name!r}: unknown name (expected param.<name>, "
                             f"optim.<key> or array.<name>)")
    out["optimizer_state"] = _unflatten(opt_flat)
    return out
