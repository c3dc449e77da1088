"""Training: the loss falls, resuming is exact, AMP skips overflowing steps,
the train/sample commands, and the loss-curve PNG."""
import copy
import math
import os
import struct
import zlib

import numpy as np
import pytest

import mamba_ext
from mamba_ext.training.data import ByteBatches
from mamba_ext.training.loop import TrainConfig, amp_step, train

TEXT = (b"The quick brown fox jumps over the lazy dog. " * 3
        + b"def add(a, b):\n    return a + b\n\n" * 3
        + b"Pack my box with five dozen liquor jugs!\n") * 40


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_bytes(TEXT)
    return str(p)


def _tiny(text_file, **kw):
    cfg = dict(data=text_file, d_model=32, n_layers=1, d_state=8, seq_len=32, batch=8,
               steps=8, lr=1e-2, warmup=5, checkpoint_every=3, threads=1)
    cfg.update(kw)
    return TrainConfig(**cfg)


def test_short_run_learns_well_below_uniform(text_file, tmp_path):
    res = train(_tiny(text_file, steps=100), tmp_path / "run", progress=None, log=lambda s: None)
    losses = res["losses"]
    assert len(losses) == 100 and all(np.isfinite(losses))
    assert abs(losses[0] - math.log(256)) < 0.1          # starts at a uniform guess
    assert res["final_loss"] == pytest.approx(np.mean(losses[-50:]))
    # the mean of the last 50 steps is below 2 nats, more than 3 below where the run began
    assert res["final_loss"] < min(2.0, losses[0] - 3.0)
    assert res["val_loss"] is not None and res["val_loss"] < 2.5
    assert res["tokens_per_s"] > 0


@pytest.mark.parametrize("amp", [False, True])
def test_resume_continues_exactly(text_file, tmp_path, amp):
    cfg = _tiny(text_file, amp=amp)
    full = train(copy.deepcopy(cfg), tmp_path / "a", progress=None, log=lambda s: None)
    part = train(copy.deepcopy(cfg), tmp_path / "b", progress=None, log=lambda s: None,
                 stop_after=5)
    assert len(part["losses"]) == 5
    resumed = train(copy.deepcopy(cfg), tmp_path / "b", resume=part["checkpoint"], progress=None,
                    log=lambda s: None)
    assert resumed["losses"] == full["losses"]            # bit-identical losses, every step
    for k in full["params"]:
        np.testing.assert_array_equal(resumed["params"][k], full["params"][k], err_msg=k)


def test_amp_step_skips_on_overflow_and_leaves_moments_untouched(text_file):
    from mamba_ext.amp import DynamicLossScaler
    params = mamba_ext.init_model_params(256, 16, 1, d_state=4, seed=0)
    opt = mamba_ext.AdamW(params, lr=1e-2)
    tok, tgt = ByteBatches(np.frombuffer(TEXT, np.uint8), 16, 4).get(0)
    # one applied step first, so that the moments are non-zero
    scaler = DynamicLossScaler(init_scale=2.0 ** 10)
    loss, applied = amp_step(tok, tgt, params, opt, scaler, n_threads=1)
    assert applied and np.isfinite(loss)
    before_w = {k: v.copy() for k, v in params.items()}
    before_state = copy.deepcopy(opt.state_dict())
    scaler = DynamicLossScaler(init_scale=2.0 ** 40, max_scale=2.0 ** 50)  # fp16 grads overflow
    loss, applied = amp_step(tok, tgt, params, opt, scaler, n_threads=1)
    assert not applied and scaler.skipped == 1 and scaler.scale == 2.0 ** 39
    for k in params:
        np.testing.assert_array_equal(params[k], before_w[k], err_msg=k)
    _assert_same_state(opt.state_dict(), before_state)
    loss, applied = amp_step(tok, tgt, params, opt, DynamicLossScaler(init_scale=2.0 ** 8), n_threads=1)
    assert applied
    assert any(not np.array_equal(params[k], before_w[k]) for k in params)


def _assert_same_state(a, b):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


def _read_png(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        n, = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        crc, = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(tag + body) & 0xFFFFFFFF == crc, tag
        chunks[tag] = chunks.get(tag, b"") + body
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)
    assert depth == 8 and color == 2 and np.all(raw[:, 0] == 0)
    return raw[:, 1:].reshape(h, w, 3)


def test_png_encoder_round_trips_pixels():
    from mamba_ext.training.plot import loss_curve, png_bytes
    img = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    np.testing.assert_array_equal(_read_png(png_bytes(img)), img)
    curve = loss_curve(np.linspace(5.5, 1.0, 300), reference=math.log(256))
    assert curve.shape == (400, 640, 3) and np.any(np.all(curve == (20, 40, 160), axis=-1))


def _has(img, color):
    return bool(np.any(np.all(img == color, axis=-1)))


def test_loss_plot_has_axis_titles_and_a_legend():
    from mamba_ext.training import plot
    top, bottom = 50, 400 - 30       # the plot area of loss_curve's layout
    with_ref = plot.loss_curve(np.linspace(5.5, 1.0, 300), reference=math.log(256))
    without = plot.loss_curve(np.linspace(5.5, 1.0, 300))
    # the legend (top margin, outside the plot area): a sample of each line
    margin = with_ref[:top - 2]
    for color in (plot.RAW_COLOR, plot.AVERAGE_COLOR, plot.REFERENCE_COLOR):
        assert _has(margin, color), color
    assert not _has(without[:top - 2], plot.REFERENCE_COLOR)    # no reference: no entry
    # the titles: the text drawn alone at the title positions is in the picture
    for title, (x, y) in ((plot.Y_TITLE, (4, 4)),
                          (plot.X_TITLE, ((60 + 625) // 2 - 4 * len(plot.X_TITLE), bottom + 12))):
        alone = np.full_like(with_ref, 255)
        plot._text(alone, x, y, title, plot.TEXT_COLOR)
        ink = np.all(alone == plot.TEXT_COLOR, axis=-1)
        assert ink.sum() > 20 * len(title.replace(" ", ""))          # really drawn
        assert np.all(with_ref[ink] == plot.TEXT_COLOR), title
    # every glyph the titles and legend use exists (no blank letters)
    text = plot.X_TITLE + plot.Y_TITLE + "loss per step moving average ln(256) = uniform guess"
    assert set(text.upper()) <= set(plot._GLYPHS)


def test_train_and_sample_commands(text_file, tmp_path, capsys):
    from mamba_ext.__main__ import main
    out = tmp_path / "run"
    rc = main(["train", "--data", text_file, "--d-model", "16", "--n-layers", "1", "--d-state", "4",
               "--seq-len", "16", "--batch", "4", "--steps", "6", "--out", str(out),
               "--checkpointing", "--threads", "1"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "step      6/6" in err and "tok/s" in err and "tokens/s" in err
    assert (out / "checkpoint.safetensors").is_file()
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "loss curve: " in err and "(drawn by " in err
    from mamba_ext.io.checkpoint import load_checkpoint
    ck = load_checkpoint(out / "checkpoint.safetensors")
    assert ck["step"] == 6 and ck["config"]["checkpointing"] is True
    rc = main(["sample", "--checkpoint", str(out), "--prompt", "The ", "--tokens", "12",
               "--seed", "1"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.startswith("The ") and len(text.encode("utf-8", "surrogateescape")) >= 12
    rc = main(["train", "--resume", str(out / "missing.safetensors")])
    assert rc == 2


def test_batches_are_a_function_of_seed_and_step():
    data = np.frombuffer(TEXT, np.uint8)
    a, b = ByteBatches(data, 16, 4, seed=3), ByteBatches(data, 16, 4, seed=3)
    for step in (0, 7, 7, 123):
        ta, ya = a.get(step)
        tb, yb = b.get(step)
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(ta[:, 1:], ya[:, :-1])   # targets are the next bytes
    assert not np.array_equal(a.get(1)[0], a.get(2)[0])
    with pytest.raises(ValueError, match="seq_len"):
        ByteBatches(data[:10], 16, 4)


def _in_ci():
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _gpu_available():
    try:
        import mamba_ext.gpu as g
        return bool(g.available())
    except Exception:
        return False


def test_gpu_training_matches_cpu_first_loss(text_file, tmp_path):
    if not _gpu_available():
        if _in_ci():
            pytest.fail("no GPU adapter in CI")
        pytest.skip("no wgpu adapter here")
    cfg = _tiny(text_file, steps=4, device="gpu")
    gpu = train(cfg, tmp_path / "g", progress=None, log=lambda s: None)
    cpu = train(_tiny(text_file, steps=4), tmp_path / "c", progress=None, log=lambda s: None)
    assert abs(gpu["losses"][0] - cpu["losses"][0]) <= 1e-4 * cpu["losses"][0]
    assert gpu["losses"][-1] < gpu["losses"][0]
    from mamba_ext.io.checkpoint import load_checkpoint
    ck = load_checkpoint(gpu["checkpoint"])
    assert ck["step"] == 4 and set(ck["params"]) == set(cpu["params"])


def test_gpu_training_checkpointing_same_losses(text_file, tmp_path):
    """train --device gpu --checkpointing: the GPU trainer recomputes each layer's
    forward before its backward; the losses are bit for bit those without it."""
    if not _gpu_available():
        if _in_ci():
            pytest.fail("no GPU adapter in CI")
        pytest.skip("no wgpu adapter here")
    quiet = dict(progress=None, log=lambda s: None)
    plain = train(_tiny(text_file, steps=3, n_layers=2, device="gpu"), tmp_path / "p", **quiet)
    ckpt = train(_tiny(text_file, steps=3, n_layers=2, device="gpu", checkpointing=True),
                 tmp_path / "k", **quiet)
    assert ckpt["losses"] == plain["losses"]


def test_gpu_training_pipelined_steps_and_checkpoints_exact(text_file, tmp_path, monkeypatch):
    """train --device gpu submits each step before reading back the one before
    (ResidentTrainer.step_async): the same losses and weights, bit for bit, as reading
    every step back before the next; a checkpoint in the middle (checkpoint_every 3) holds
    exactly its steps, so a run resumed from it equals the whole run."""
    if not _gpu_available():
        if _in_ci():
            pytest.fail("no GPU adapter in CI")
        pytest.skip("no wgpu adapter here")
    import shutil

    from mamba_ext.gpu.trainer import ResidentTrainer
    from mamba_ext.training import loop
    quiet = dict(progress=None, log=lambda s: None)
    cfg = _tiny(text_file, steps=7, n_layers=2, device="gpu")
    real_save, mid = loop.save_state, tmp_path / "mid.safetensors"

    def keep_mid(path, cfg, step, *a, **k):     # a copy of the checkpoint after step 3
        real_save(path, cfg, step, *a, **k)
        if step == 3:
            shutil.copy(path, mid)
    monkeypatch.setattr(loop, "save_state", keep_mid)
    full = train(copy.deepcopy(cfg), tmp_path / "a", **quiet)
    monkeypatch.setattr(loop, "save_state", real_save)
    resumed = train(copy.deepcopy(cfg), tmp_path / "b", resume=str(mid), **quiet)
    real = ResidentTrainer.step_async
    submitted = []

    def one_by_one(self, tokens, targets):       # each step read back before the next
        p = real(self, tokens, targets)
        submitted.append(p.result())
        return p
    monkeypatch.setattr(ResidentTrainer, "step_async", one_by_one)
    serial = train(copy.deepcopy(cfg), tmp_path / "c", **quiet)
    assert len(submitted) == 7 and serial["losses"] == submitted
    assert full["losses"] == serial["losses"] == resumed["losses"]
    for k in full["params"]:
        np.testing.assert_array_equal(resumed["params"][k], full["params"][k], err_msg=k)
        np.testing.assert_array_equal(serial["params"][k], full["params"][k], err_msg=k)


def test_gpu_amp_training_resumes_exactly(text_file, tmp_path):
    """train --device gpu --amp: the scaler's state is checkpointed with the run and a
    resume continues bit for bit (losses and weights); the CPU's first loss matches."""
    if not _gpu_available():
        if _in_ci():
            pytest.fail("no GPU adapter in CI")
        pytest.skip("no wgpu adapter here")
    from mamba_ext.training.loop import load_training_checkpoint
    quiet = dict(progress=None, log=lambda s: None)
    cfg = _tiny(text_file, steps=5, n_layers=2, device="gpu", amp=True)
    full = train(copy.deepcopy(cfg), tmp_path / "a", **quiet)
    part = train(copy.deepcopy(cfg), tmp_path / "b", stop_after=3, **quiet)
    assert load_training_checkpoint(part["checkpoint"])["scaler_state"]["scale"] > 0
    resumed = train(copy.deepcopy(cfg), tmp_path / "b", resume=part["checkpoint"], **quiet)
    assert resumed["losses"] == full["losses"]
    for k in full["params"]:
        np.testing.assert_array_equal(resumed["params"][k], full["params"][k], err_msg=k)
    cpu = train(_tiny(text_file, steps=1, n_layers=2, amp=True), tmp_path / "c", **quiet)
    assert abs(full["losses"][0] - cpu["losses"][0]) <= 1e-4 * cpu["losses"][0]


def test_gpu_unavailable_gives_a_clear_error(text_file, tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "mamba_ext.gpu", None)    # import fails
    with pytest.raises(RuntimeError, match="--device gpu: the GPU executor is unavailable"):
        train(_tiny(text_file, device="gpu"), tmp_path / "x", progress=None, log=lambda s: None)


def test_gpu_resume_restores_optimizer_state(text_file, tmp_path):
    if not _gpu_available():
        if _in_ci():
            pytest.fail("no GPU adapter in CI")
        pytest.skip("no wgpu adapter here")
    from mamba_ext.io.checkpoint import load_checkpoint
    cfg = _tiny(text_file, steps=6, device="gpu")
    quiet = dict(progress=None, log=lambda s: None)
    full = train(copy.deepcopy(cfg), tmp_path / "a", **quiet)
    part = train(copy.deepcopy(cfg), tmp_path / "b", stop_after=3, **quiet)
    ck = load_checkpoint(part["checkpoint"])["optimizer_state"]
    cpu_keys = set(load_checkpoint(train(_tiny(text_file, steps=1), tmp_path / "c", **quiet)
                                   ["checkpoint"])["optimizer_state"])
    assert set(ck) == cpu_keys and ck["step"] == 3          # same keys as a CPU checkpoint
    resumed = train(copy.deepcopy(cfg), tmp_path / "b", resume=part["checkpoint"], **quiet)
    assert resumed["losses"] == full["losses"]            # bit-identical losses, every step
    for k in full["params"]:
        np.testing.assert_array_equal(resumed["params"][k], full["params"][k], err_msg=k)


def test_loss_plot_writers(tmp_path, monkeypatch):
    """matplotlib draws the curve when it is installed (CI installs it), the built-in writer
    otherwise; both mark the held-out loss and say which wrote the file."""
    import builtins
    from conftest import optional
    from mamba_ext.training import plot
    optional("matplotlib", "pip install matplotlib")
    y = 5.5 * np.exp(-np.arange(300) / 40.0) + 1.0
    path = tmp_path / "m.png"
    assert plot.write_loss_curve(path, y, reference=math.log(256), held_out=1.2) == "matplotlib"
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    path = tmp_path / "b.png"
    assert plot.write_loss_curve(path, y, reference=math.log(256), held_out=1.2) == "built-in"
    img = _read_png(path.read_bytes())
    top = 50
    assert _has(img[:top - 2], plot.HELD_OUT_COLOR)          # its legend entry
    assert _has(img[top:], plot.HELD_OUT_COLOR)              # the marker
    without = plot.loss_curve(y)
    assert not _has(without, plot.HELD_OUT_COLOR)
