"""train --carry-state: contiguous windows, the model's state carried across steps
(issue 14, part 3)."""
import numpy as np
import pytest

from mamba_ext.training import loop
from mamba_ext.training.data import ContiguousBatches
from mamba_ext.training.loop import TrainConfig, load_training_checkpoint, train


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"(", b")", b"\n", b" "]
    text = b"".join(words[i] for i in rng.integers(0, len(words), 3000))
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    return str(path)


def _cfg(corpus, **kw):
    d = dict(data=corpus, d_model=16, n_layers=2, d_state=4, seq_len=16, batch=3, steps=8,
             lr=3e-3, warmup=2, checkpoint_every=0, threads=1, carry_state=True)
    d.update(kw)
    return TrainConfig(**d)


def test_contiguous_batches_continue_row_by_row():
    data = np.arange(1000) % 251
    b = ContiguousBatches(data.astype(np.uint8), seq_len=10, batch=4)
    assert b.n_windows == (b.stream_len - 1) // 10 and b.starts_pass(0) and not b.starts_pass(1)
    for k in range(b.n_windows - 1):
        tok, tgt = b.get(k)
        nxt, _ = b.get(k + 1)
        np.testing.assert_array_equal(tok[:, 1:], tgt[:, :-1])
        np.testing.assert_array_equal(nxt[:, 0], tgt[:, -1])       # row b goes on where it ended
    assert b.starts_pass(b.n_windows)
    np.testing.assert_array_equal(b.get(b.n_windows)[0], b.get(0)[0])
    with pytest.raises(ValueError, match="streams"):
        ContiguousBatches(np.zeros(60, np.uint8), seq_len=20, batch=4, val_fraction=0)


def test_the_state_passed_is_the_last_windows_return(corpus, tmp_path, monkeypatch):
    calls = []
    real = loop.model_loss_and_grads

    def spy(*args, **kw):
        out = real(*args, **kw)
        calls.append((kw.get("h0"), kw.get("conv_state"), out[2]))
        return out

    monkeypatch.setattr(loop, "model_loss_and_grads", spy)
    small = tmp_path / "small.txt"          # 400 bytes: 3 streams of 133, 8 windows of 16
    small.write_bytes(open(corpus, "rb").read()[:400])
    summary = train(_cfg(str(small), steps=12), tmp_path / "run", progress=None, log=lambda m: None)
    n_windows = ContiguousBatches(np.frombuffer(small.read_bytes(), np.uint8), 16, 3).n_windows
    assert len(calls) == 12 and 12 > n_windows          # the streams wrap around once at least
    for k, (h0, conv, _) in enumerate(calls):
        if k % n_windows == 0:
            assert h0 is None and conv is None, k        # a new pass starts from zeros
        else:
            prev = calls[k - 1][2]
            assert h0 is prev[0] and conv is prev[1], k
            assert h0.shape == (2, 3, 32, 4) and np.abs(h0).max() > 0
    assert np.isfinite(summary["final_loss"])
    ck = load_training_checkpoint(tmp_path / "run" / "checkpoint.safetensors")
    assert ck["config"].carry_state
    np.testing.assert_array_equal(ck["carry"][0], calls[-1][2][0])


def test_resume_carries_the_state_exactly(corpus, tmp_path):
    full = train(_cfg(corpus), tmp_path / "a", progress=None, log=lambda m: None)
    train(_cfg(corpus), tmp_path / "b", progress=None, log=lambda m: None, stop_after=5)
    resumed = train(_cfg(corpus), tmp_path / "b", resume=str(tmp_path / "b" / "checkpoint.safetensors"),
                    progress=None, log=lambda m: None)
    assert resumed["losses"] == full["losses"]
    for k in full["params"]:
        np.testing.assert_array_equal(resumed["params"][k], full["params"][k])


def test_carry_state_refusals_and_cli(corpus, tmp_path):
    with pytest.raises(ValueError, match="carry-state"):
        train(_cfg(corpus, amp=True), tmp_path / "x", progress=None, log=lambda m: None)
    from mamba_ext.cli.train import main
    assert main(["--data", corpus, "--d-model", "16", "--n-layers", "1", "--d-state", "4",
                 "--seq-len", "16", "--batch", "2", "--steps", "3", "--carry-state",
                 "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    assert load_training_checkpoint(tmp_path / "cli" / "checkpoint.safetensors")["config"].carry_state
