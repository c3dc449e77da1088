"""safetensors checkpoints written by mamba_ext.io.checkpoint: exact round trips,
interoperability with the safetensors package, and refusal of damaged files."""
import os

import numpy as np
import pytest
from conftest import optional

import mamba_ext
from mamba_ext.io import checkpoint as ck


def _tensors():
    rng = np.random.default_rng(0)
    return {
        "w32": rng.standard_normal((3, 5)).astype(np.float32),
        "w64": rng.standard_normal(7),
        "h16": rng.standard_normal(4).astype(np.float16),
        "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
        "u8": np.arange(5, dtype=np.uint8),
        "scalar": np.array(2.5),
        "empty": np.zeros((0, 4), np.float32),
        "nan_inf": np.array([np.nan, np.inf, -np.inf, -0.0], np.float32),
        "fortran": np.asfortranarray(rng.standard_normal((3, 2))),
    }


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == np.ascontiguousarray(b).tobytes()


def test_round_trip_is_exact(tmp_path):
    t = _tensors()
    path = tmp_path / "a.safetensors"
    ck.save(path, t, {"note": "hello"})
    back, meta = ck.load(path)
    assert list(back) == list(t) and meta == {"note": "hello"}       # the digest is checked, then dropped
    assert ck.CHECKSUM_KEY.encode() in path.read_bytes()
    for k in t:
        _same(back[k], t[k])
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_interoperates_with_the_safetensors_package(tmp_path):
    st = optional("safetensors.numpy", "pip install safetensors")
    t = _tensors()
    ck.save(tmp_path / "ours.safetensors", t)
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    for k in t:
        _same(theirs[k], t[k])
    st.save_file({k: np.asarray(v, order="C") for k, v in t.items()}, str(tmp_path / "theirs.safetensors"))
    with pytest.raises(ValueError, match="no mamba_ext.file_sha256 digest"):
        ck.load(tmp_path / "theirs.safetensors")
    back, _ = ck.load(tmp_path / "theirs.safetensors", require_checksum=False)
    for k in t:
        _same(back[k], t[k])


def _training_checkpoint(path):
    params = mamba_ext.init_model_params(11, 8, 2, d_state=4, seed=3)
    opt = mamba_ext.AdamW(params, lr=1e-2)
    rng = np.random.default_rng(1)
    opt.step({k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in params.items()})
    cfg = {"d_model": 8, "betas": [0.9, 0.99], "data": None}
    ck.save_checkpoint(path, params, step=17, config=cfg, optimizer_state=opt.state_dict(),
                       extra={"scaler": {"scale": 1024.0}}, arrays={"losses": np.arange(17.0)})
    return params, opt, cfg


def _assert_state_equal(a, b, where="state"):
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _assert_state_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, np.ndarray):
        _same(np.asarray(b), a)
    elif isinstance(a, tuple):
        assert list(a) == list(b), where
    else:
        assert a == b, where


def test_training_checkpoint_round_trip(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    params, opt, cfg = _training_checkpoint(path)
    got = ck.load_checkpoint(path)
    assert got["step"] == 17 and got["config"] == cfg
    assert got["extra"] == {"scaler": {"scale": 1024.0}}
    _same(got["arrays"]["losses"], np.arange(17.0))
    assert list(got["params"]) == list(params)
    for k in params:
        _same(got["params"][k], params[k])
    _assert_state_equal(opt.state_dict(), got["optimizer_state"])
    # the restored optimizer continues exactly like the original one
    p2 = {k: v.copy() for k, v in got["params"].items()}
    opt2 = mamba_ext.AdamW(p2, lr=1e-2)
    opt2.load_state_dict(got["optimizer_state"])
    g = {k: np.full(v.shape, 0.1, v.dtype) for k, v in params.items()}
    opt.step(g)
    opt2.step({k: v.copy() for k, v in g.items()})
    for k in params:
        _same(p2[k], params[k])


def _damage(path, how):
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    if how == "truncated":
        raw = raw[:len(raw) - 10]
    elif how == "truncated_header":
        raw = raw[:8 + n // 2]
    elif how == "data_byte":
        raw[8 + n + 20] ^= 0x01
    elif how == "header_json":
        raw[8 + 1] = ord("#")
    elif how == "header_len":
        raw[:8] = (len(raw) * 2).to_bytes(8, "little")
    elif how == "shape":       # same header length, a shape that disagrees with the offsets
        hdr = bytes(raw[8:8 + n])
        assert b'"shape":[3,5]' in hdr
        raw[8:8 + n] = hdr.replace(b'"shape":[3,5]', b'"shape":[5,4]')
    elif how == "trailing":
        raw += b"\0" * 8
    elif how == "empty":
        raw = b""
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how,message", [
    ("truncated", "truncated"), ("truncated_header", "truncated"),
    ("data_byte", "checksum mismatch"), ("header_json", "not valid JSON"),
    ("header_len", "header length"), ("shape", "data_offsets"), ("trailing", "trailing"),
    ("empty", "shorter than"),
])
def test_damaged_file_is_refused(tmp_path, how, message):
    path = tmp_path / "x.safetensors"
    ck.save(path, _tensors())
    _damage(path, how)
    with pytest.raises(ValueError, match=message) as e:
        ck.load(path)
    assert str(path) in str(e.value)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    params, opt, cfg = _training_checkpoint(path)
    before = path.read_bytes()

    def crash(fd):   # the machine "dies" after the data is written but before the rename
        raise OSError("disk full")
    monkeypatch.setattr(ck.os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(path, {k: v + 1 for k, v in params.items()}, step=18, config=cfg)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert ck.load_checkpoint(path)["step"] == 17
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]     # no temp file left behind


def test_a_truncated_new_checkpoint_is_refused_and_old_one_loads(tmp_path):
    good = tmp_path / "good.safetensors"
    _training_checkpoint(good)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        ck.load_checkpoint(bad)
    assert ck.load_checkpoint(good)["step"] == 17


def test_not_a_training_checkpoint(tmp_path):
    ck.save(tmp_path / "plain.safetensors", {"a": np.zeros(2)})
    with pytest.raises(ValueError, match="not a mamba_ext training checkpoint"):
        ck.load_checkpoint(tmp_path / "plain.safetensors")
