"""The initialisation schemes of init_mamba1_params / init_model_params (issue 14, part 1)."""
import math

import numpy as np
import pytest

import mamba_ext
from mamba_ext.block import DT_FLOOR, DT_MAX, DT_MIN, INIT_SCHEMES, inverse_softplus
from mamba_ext.training.loop import TrainConfig


def softplus(x):
    return np.logaddexp(0.0, np.asarray(x, np.float64))


def legacy_formula(d_model, d_state=16, d_conv=4, expand=2, dt_rank=None, seed=0, dtype=np.float32):
    """The rules of init_mamba1_params before issue 14, written out again: the legacy
    scheme must give these values bit for bit."""
    D, R = expand * d_model, dt_rank or math.ceil(d_model / 16)
    P = R + 2 * d_state
    rng = np.random.default_rng(seed)
    p = {"wInProj": rng.normal(0.0, 0.02, (2 * D, d_model)), "bInProj": np.zeros(2 * D),
         "wConv": rng.normal(0.0, 0.02, (D, d_conv)), "bConv": np.zeros(D),
         "wXProj": rng.normal(0.0, 0.02, (P, D)), "bXProj": np.zeros(P)}
    p["wOutProj"] = rng.normal(0.0, 0.02, (d_model, D))
    p["wDtProj"] = rng.uniform(-R ** -0.5, R ** -0.5, (D, R))
    p["bDtProj"] = np.zeros(D)
    p["A_log"] = np.tile(np.log(np.arange(1, d_state + 1.0)), (D, 1))
    p["D_vec"] = np.ones(D)
    p["bOutProj"] = np.zeros(d_model)
    p["normWeight"] = np.ones(d_model)
    return {k: v.astype(dtype) for k, v in p.items()}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_legacy_reproduces_the_old_values_bit_for_bit(dtype):
    got = mamba_ext.init_mamba1_params(24, d_state=5, d_conv=3, seed=7, dtype=dtype, init="legacy")
    want = legacy_formula(24, d_state=5, d_conv=3, seed=7, dtype=dtype)
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == np.dtype(dtype)
        assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), k


def test_legacy_model_layers_use_the_old_block_values():
    p = mamba_ext.init_model_params(40, 16, 2, d_state=4, seed=3, init="legacy")
    ss = np.random.SeedSequence(3)
    _, *layer_seqs = ss.spawn(3)
    for i, sq in enumerate(layer_seqs):
        want = legacy_formula(16, d_state=4, seed=int(sq.generate_state(1, dtype=np.uint32)[0]))
        for k, v in want.items():
            assert np.array_equal(p[f"layer{i}.{k}"], v), (i, k)


def test_inverse_softplus_is_exact():
    delta = np.geomspace(DT_FLOOR, 10.0, 2001)
    back = softplus(inverse_softplus(delta))
    np.testing.assert_allclose(back, delta, rtol=4e-15, atol=0)


def test_mamba_delta_is_log_uniform_in_the_paper_range():
    p = mamba_ext.init_mamba1_params(512, expand=4, seed=1, dtype=np.float64)   # D = 2048
    delta0 = softplus(p["bDtProj"])
    assert delta0.min() >= DT_MIN * (1 - 1e-12) and delta0.max() <= DT_MAX * (1 + 1e-12)
    # log-uniform: log(delta0) uniform on [log 1e-3, log 1e-1], mean and std of that law
    z = (np.log(delta0) - np.log(DT_MIN)) / (np.log(DT_MAX) - np.log(DT_MIN))     # ~ U(0, 1)
    assert abs(z.mean() - 0.5) < 0.03 and abs(z.std() - (1 / 12) ** 0.5) < 0.02
    assert np.histogram(z, bins=4, range=(0, 1))[0].min() > 0.2 * z.size
    # float32: the bias is the float32 rounding of the float64 inverse softplus
    p32 = mamba_ext.init_mamba1_params(512, expand=4, seed=1, dtype=np.float32)
    assert np.array_equal(p32["bDtProj"], p["bDtProj"].astype(np.float32))


def test_mamba_rules_of_every_parameter():
    Dm, N, K, E, R = 64, 8, 4, 2, 4
    D = E * Dm
    p = mamba_ext.init_mamba1_params(Dm, d_state=N, d_conv=K, expand=E, seed=2, dtype=np.float64)
    for name, fan_in in (("wInProj", Dm), ("wXProj", D), ("wConv", K), ("bConv", K),
                         ("wDtProj", R), ("wOutProj", D)):
        a, b = p[name], fan_in ** -0.5
        assert np.abs(a).max() <= b, name
        assert np.abs(a).max() > 0.9 * b, name                   # fills the range
        assert abs(a.std() - b / 3 ** 0.5) < 0.1 * b / 3 ** 0.5, name   # std of U(±b)
    for name in ("bInProj", "bXProj", "bOutProj"):
        assert not p[name].any(), name
    assert np.array_equal(p["A_log"], np.tile(np.log(np.arange(1, N + 1.0)), (D, 1)))
    assert np.array_equal(p["D_vec"], np.ones(D)) and np.array_equal(p["normWeight"], np.ones(Dm))


def test_out_proj_is_rescaled_with_depth():
    one = mamba_ext.init_mamba1_params(32, seed=5, dtype=np.float64, n_layers=1)
    nine = mamba_ext.init_mamba1_params(32, seed=5, dtype=np.float64, n_layers=9)
    np.testing.assert_allclose(nine["wOutProj"], one["wOutProj"] / 3.0, rtol=1e-15)
    for k in one:
        if k != "wOutProj":
            assert np.array_equal(one[k], nine[k]), k
    # the model passes its depth to every layer
    m = mamba_ext.init_model_params(50, 32, 4, seed=0, dtype=np.float64)
    for i in range(4):
        assert np.abs(m[f"layer{i}.wOutProj"]).max() <= (64 ** -0.5) / 2.0
        assert np.abs(m[f"layer{i}.wOutProj"]).max() > 0.9 * (64 ** -0.5) / 2.0
    assert abs(m["embedding"].std() - 0.02) < 0.002


def test_default_is_mamba_and_bad_scheme_is_refused():
    assert INIT_SCHEMES == ("mamba", "legacy")
    a = mamba_ext.init_mamba1_params(16, seed=0)
    b = mamba_ext.init_mamba1_params(16, seed=0, init="mamba")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["bDtProj"].min() < -2.0        # delta0 <= 0.1: inverse softplus < -2.25
    with pytest.raises(ValueError, match="init"):
        mamba_ext.init_mamba1_params(16, init="xavier")
    with pytest.raises(ValueError, match="init"):
        mamba_ext.init_model_params(10, 16, 1, init="")
    with pytest.raises(ValueError, match="n_layers"):
        mamba_ext.init_mamba1_params(16, n_layers=0)


def test_the_mixer_is_no_longer_silent():
    """With the legacy init the mixer branch of a fresh block is ~7e-5 of its output;
    with the reference rules ~4e-2 (Dm 64, one layer), over 100 times more."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 64, 64))
    ratio = {}
    for init in INIT_SCHEMES:
        p = mamba_ext.init_mamba1_params(64, seed=0, dtype=np.float64, init=init)
        out, _ = mamba_ext.mamba1_forward(x, p)
        ratio[init] = np.linalg.norm(out - x) / np.linalg.norm(out)
    assert ratio["legacy"] < 1e-3 and ratio["mamba"] > 100 * ratio["legacy"]


def test_training_config_records_the_scheme():
    assert TrainConfig().init == "mamba"
    d = TrainConfig().to_dict()
    assert d["init"] == "mamba"
    del d["init"]          # a checkpoint written before the field existed
    assert TrainConfig.from_dict(d).init == "legacy"
    with pytest.raises(ValueError, match="config.init"):
        TrainConfig(init="zeros").validated()


def test_the_default_train_run_uses_the_mamba_init(tmp_path):
    from mamba_ext.cli.train import main
    from mamba_ext.training.loop import load_training_checkpoint
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 40)
    for extra, scheme in (([], "mamba"), (["--init", "legacy"], "legacy")):
        out = tmp_path / scheme
        rc = main(["--data", str(data), "--d-model", "16", "--n-layers", "2", "--d-state", "4",
                   "--seq-len", "16", "--batch", "2", "--steps", "1", "--out", str(out),
                   "--quiet"] + extra)
        assert rc == 0
        ck = load_training_checkpoint(out / "checkpoint.safetensors")
        assert ck["config"].init == scheme
        bias = ck["params"]["layer0.bDtProj"]
        # one AdamW step moves a bias by at most ~lr: the legacy 0 stays near 0
        assert (bias.max() < -2.0) if scheme == "mamba" else (np.abs(bias).max() < 0.05)
