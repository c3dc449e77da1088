"""Checkpoint integrity (issue 13): every byte of a checkpoint is authenticated, every
malformed field ends in one ValueError naming the file and the field, and a training
checkpoint is checked against its model before anything uses it (resume, sample, load_hf).

The corruption sweep flips every byte of a small training checkpoint's length prefix,
header and metadata (and a sample of its tensor data): each damaged file must be refused
with a ValueError or load content identical to the original (with a whole-file digest:
refused, every time).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mamba_ext.io import checkpoint as ck
from mamba_ext.io.hf import load_hf, save_hf
from mamba_ext.training.loop import CHECKPOINT_NAME, TrainConfig, load_training_checkpoint, train

TEXT = b"integrity: every byte of a checkpoint is authenticated.\n" * 40


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real (tiny) training run: checkpoint.safetensors with params, AdamW and scaler state."""
    d = tmp_path_factory.mktemp("run")
    (d / "corpus.txt").write_bytes(TEXT)
    cfg = TrainConfig(data=str(d / "corpus.txt"), d_model=8, n_layers=1, d_state=2, seq_len=8,
                      batch=2, steps=3, warmup=1, checkpoint_every=0, threads=1, amp=True)
    train(cfg, d / "out", progress=None, log=lambda s: None)
    return d / "out"


def _split(raw: bytes):
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def _resign(header: dict, data: bytes) -> bytes:
    """A file with this header and data and a CORRECT digest (computed here independently
    of mamba_ext: sha256 of the file with the digest's hex digits zeroed), i.e. what a
    buggy or hostile writer could produce: only the structure checks can refuse it."""
    meta = dict(header.get("__metadata__", {}))
    meta[ck.CHECKSUM_KEY] = "0" * 64
    header = dict(header, __metadata__=meta)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    prefix = len(hb).to_bytes(8, "little")
    digest = hashlib.sha256(prefix + hb + data).hexdigest()
    return prefix + hb.replace(b'"' + b"0" * 64 + b'"', b'"' + digest.encode() + b'"', 1) + data


def _same_content(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, np.ndarray):
            return isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape \
                and x.tobytes() == y.tobytes()
        if isinstance(x, TrainConfig):
            return x == y
        return x == y and type(x) is type(y)
    return eq(a, b)


def test_corruption_sweep_every_header_and_metadata_byte(run_dir, tmp_path):
    raw = (run_dir / CHECKPOINT_NAME).read_bytes()
    original = load_training_checkpoint(run_dir / CHECKPOINT_NAME)
    n = int.from_bytes(raw[:8], "little")
    positions = list(range(8 + n)) + list(range(8 + n, len(raw), 97))   # + a sample of the data
    path = tmp_path / "damaged.safetensors"
    refused = identical = 0
    for pos in positions:
        for mask in (0x01, 0xFF):
            damaged = bytearray(raw)
            damaged[pos] ^= mask
            path.write_bytes(bytes(damaged))
            try:
                got = load_training_checkpoint(path)
            except ValueError as e:
                assert str(path) in str(e), (pos, mask, str(e))
                refused += 1
            else:
                assert _same_content(got, original), f"byte {pos} ^ {mask:#x} loaded altered content"
                identical += 1
    total = 2 * len(positions)
    assert refused + identical == total and total > 2 * 8 * 100
    print(f"corruption sweep: {total} single-byte flips ({8 + n} header/metadata bytes and "
          f"{len(positions) - 8 - n} data bytes, x2 masks): {refused} refused, {identical} identical")


def test_resigned_structural_damage_names_the_file_and_the_field(run_dir, tmp_path):
    raw = (run_dir / CHECKPOINT_NAME).read_bytes()
    _, header, data = _split(raw)
    emb = header["param.embedding"]
    cases = {
        "shape 2**70": ({"param.embedding": dict(emb, shape=[2 ** 70])}, "field 'data_offsets'"),
        "dtype [1]": ({"param.embedding": dict(emb, dtype=[1])}, "field 'dtype'"),
        "dtype bogus": ({"param.embedding": dict(emb, dtype="F128")}, "field 'dtype'"),
        "shape true": ({"param.embedding": dict(emb, shape=[True, 8 * 256])}, "field 'shape'"),
        "offsets float": ({"param.embedding": dict(emb, data_offsets=[0.0, 1.0])}, "field 'data_offsets'"),
        "I32 relabel": ({"param.embedding": dict(emb, dtype="I32")}, "field 'dtype'"),
        "wrong shape": ({"param.embedding": dict(emb, shape=[8, 256])}, "field 'shape'"),
        "unknown tensor": ({"bogus.x": {"dtype": "F32", "shape": [0],
                                        "data_offsets": [len(data), len(data)]}}, "unknown name"),
        "step": ({"__metadata__": dict(header["__metadata__"], step="007")}, "field '__metadata__.step'"),
        "step past": ({"__metadata__": dict(header["__metadata__"], step="70")}, "field '__metadata__.step'"),
        "config lr": ({"__metadata__": dict(header["__metadata__"], config=json.dumps(
            dict(json.loads(header["__metadata__"]["config"]), lr="0.004")))}, "field '__metadata__.config'"),
        "config unknown": ({"__metadata__": dict(header["__metadata__"], config=json.dumps(
            dict(json.loads(header["__metadata__"]["config"]), bogus=1)))}, "field '__metadata__.config'"),
        "extra key": ({"__metadata__": dict(header["__metadata__"], mystery="1")}, "field '__metadata__'"),
        "data state": ({"__metadata__": dict(header["__metadata__"], extra=json.dumps(
            {"scaler": json.loads(header["__metadata__"]["extra"])["scaler"],
             "distributed": {"world_size": 2, "batch_per_rank": 2, "global_batch": 4,
                             "data_position": "12", "rank_positions": [12, 14],
                             "data_order": "sharded-stream/1"}}))},
                       "field '__metadata__.extra.distributed'.data_position"),
    }
    path = tmp_path / "resigned.safetensors"
    for what, (change, field) in cases.items():
        h = {k: v for k, v in header.items()}
        h["__metadata__"] = {k: v for k, v in header["__metadata__"].items() if k != ck.CHECKSUM_KEY}
        h.update(change)
        if "__metadata__" in change:
            h["__metadata__"].pop(ck.CHECKSUM_KEY, None)
        path.write_bytes(_resign(h, data))
        with pytest.raises(ValueError) as e:
            load_training_checkpoint(path)
        assert str(path) in str(e.value) and field in str(e.value), (what, str(e.value))
    # the untouched header, re-signed, loads: the helper itself is right
    h = dict(header, __metadata__={k: v for k, v in header["__metadata__"].items() if k != ck.CHECKSUM_KEY})
    path.write_bytes(_resign(h, data))
    assert load_training_checkpoint(path)["step"] == 3


def test_integer_and_nan_params_are_refused_by_resume_and_sample(run_dir, tmp_path):
    raw = (run_dir / CHECKPOINT_NAME).read_bytes()
    _, header, data = _split(raw)
    h = dict(header, __metadata__={k: v for k, v in header["__metadata__"].items() if k != ck.CHECKSUM_KEY})
    bad = {}
    bad["int"] = _resign(dict(h, **{"param.final_norm": dict(h["param.final_norm"], dtype="I32")}), data)
    b, e = h["param.final_norm"]["data_offsets"]
    nan_data = data[:b] + np.full((e - b) // 4, np.nan, np.float32).tobytes() + data[e:]
    bad["nan"] = _resign(h, nan_data)
    for what, content in bad.items():
        folder = tmp_path / what
        folder.mkdir()
        (folder / CHECKPOINT_NAME).write_bytes(content)
        with pytest.raises(ValueError, match="param.final_norm"):
            load_training_checkpoint(folder / CHECKPOINT_NAME)
        with pytest.raises(ValueError, match="param.final_norm"):
            train(TrainConfig(steps=5), folder, resume=str(folder / CHECKPOINT_NAME), progress=None,
                  log=lambda s: None)
        r = subprocess.run([sys.executable, "-m", "mamba_ext", "sample", "--checkpoint", str(folder),
                            "--tokens", "3"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().count("\n") == 0 and "param.final_norm" in r.stderr


def test_strict_json_duplicates_and_nan(tmp_path):
    ck.save(tmp_path / "a.safetensors", {"x": np.zeros(2, np.float32)}, {"k": "v"})
    raw = (tmp_path / "a.safetensors").read_bytes()
    n, header, data = _split(raw)
    text = json.dumps(header, separators=(",", ":"))
    dup = text.replace('"x":{', '"x":{"dtype":"F32",', 1)        # a key twice in one entry
    hb = dup.encode() + b" " * (-len(dup) % 8)
    (tmp_path / "dup.safetensors").write_bytes(len(hb).to_bytes(8, "little") + hb + data)
    with pytest.raises(ValueError, match="duplicate key 'dtype'"):
        ck.load(tmp_path / "dup.safetensors")
    with pytest.raises(ValueError, match="non-finite"):
        ck.strict_json('{"lr": NaN}', "config")


def test_legacy_files_need_an_explicit_opt_in(tmp_path):
    """mamba_ext <= 0.1 authenticated only the tensor data: refused by default."""
    a = np.arange(4, dtype=np.float32)
    legacy = {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "__metadata__": {ck.LEGACY_CHECKSUM_KEY: hashlib.sha256(a.tobytes()).hexdigest()}}
    hb = json.dumps(legacy).encode()
    hb += b" " * (-len(hb) % 8)
    path = tmp_path / "old.safetensors"
    path.write_bytes(len(hb).to_bytes(8, "little") + hb + a.tobytes())
    with pytest.raises(ValueError, match="mamba_ext <= 0.1"):
        ck.load(path)
    back, meta = ck.load(path, require_checksum=False)
    assert np.array_equal(back["x"], a) and meta == {}
    path.write_bytes(path.read_bytes()[:-1] + b"\x01")          # the legacy checksum still counts
    with pytest.raises(ValueError, match="checksum mismatch"):
        ck.load(path, require_checksum=False)


def test_load_hf_refuses_integer_tensors(tmp_path):
    from mamba_ext import init_model_params
    p = init_model_params(19, 8, 1, d_state=4, seed=0)
    save_hf(tmp_path / "m", p, {"eps": 1e-5, "discretization": "euler"})
    f = tmp_path / "m" / "model.safetensors"
    _, header, data = _split(f.read_bytes())
    meta = {k: v for k, v in header["__metadata__"].items() if k != ck.CHECKSUM_KEY}
    key = "backbone.norm_f.weight"
    h = dict(header, __metadata__=meta, **{key: dict(header[key], dtype="I32")})
    f.write_bytes(_resign(h, data))
    with pytest.raises(ValueError, match=f"{f}: tensor '{key}': field 'dtype'"):
        load_hf(tmp_path / "m")


@pytest.mark.parametrize("content, field", [
    (b"{not json", "not valid JSON"), (b"[1, 2]", "expected a JSON object"),
    (b'{"hidden_size": "8", "vocab_size": 19, "num_hidden_layers": 1}', "field 'hidden_size'"),
    (b'{"hidden_size": 8, "vocab_size": 19, "num_hidden_layers": 1, "layer_norm_epsilon": "1e-5"}',
     "field 'layer_norm_epsilon'"),
])
def test_load_hf_refuses_a_malformed_config(tmp_path, content, field):
    from mamba_ext import init_model_params
    save_hf(tmp_path / "m", init_model_params(19, 8, 1, d_state=4), {"eps": 1e-5, "discretization": "euler"})
    (tmp_path / "m" / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=field):
        load_hf(tmp_path / "m")


def test_files_honour_the_umask_and_stale_temporaries_go(tmp_path):
    old = os.umask(0o027)
    try:
        ck.save(tmp_path / "a.safetensors", {"x": np.zeros(1)})
        assert (os.stat(tmp_path / "a.safetensors").st_mode & 0o777) == 0o640
        os.umask(0o002)
        ck.save(tmp_path / "a.safetensors", {"x": np.zeros(1)})
        assert (os.stat(tmp_path / "a.safetensors").st_mode & 0o777) == 0o664
    finally:
        os.umask(old)
    stale = [tmp_path / f".checkpoint.safetensors.{s}.tmp" for s in ("abc_123", "zz9")]
    keep = [tmp_path / ".checkpoint.safetensors.tmp", tmp_path / ".other.safetensors.abc.tmp",
            tmp_path / "checkpoint.safetensors.abc.tmp"]
    for f in stale + keep:
        f.write_bytes(b"x")
    removed = ck.remove_stale_temporaries(tmp_path, "checkpoint.safetensors")
    assert sorted(removed) == sorted(map(str, stale))
    assert all(f.exists() for f in keep) and not any(f.exists() for f in stale)
