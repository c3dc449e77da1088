"""State across calls for the whole model (issue 14, part 3): model_forward /
model_loss_and_grads with per-layer h0, conv_state, return_state."""
import numpy as np
import pytest

from mamba_ext import init_model_params, model_forward, model_loss_and_grads
from mamba_ext.testing import reference as ref

V, Dm, NL, N, K = 37, 16, 3, 4, 4
D = 2 * Dm
WINDOWS = [1, 2, 61, 70, 16]          # shorter than K-1, across the 64-step scan chunk, ...
TOTAL = sum(WINDOWS)


def _params(dtype):
    return init_model_params(V, Dm, NL, d_state=N, d_conv=K, seed=4, dtype=dtype)


def _tokens(B=2, L=TOTAL, seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, L))


def _windowed(tokens, params, **kw):
    """Logits of the windows of WINDOWS, each started from the previous one's state."""
    state = (None, None)
    out, t = [], 0
    for w in WINDOWS:
        logits, state = model_forward(tokens[:, t:t + w], params, h0=state[0], conv_state=state[1],
                                      return_state=True, **kw)
        out.append(logits)
        t += w
    return np.concatenate(out, axis=1), state


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("discretization", ["zoh", "euler"])
def test_windows_equal_the_whole_sequence(dtype, tol, discretization):
    p, tok = _params(dtype), _tokens()
    whole, (h_last, conv_tail) = model_forward(tok, p, return_state=True, discretization=discretization)
    parts, (h_w, c_w) = _windowed(tok, p, discretization=discretization)
    scale = np.abs(whole).max()
    assert np.abs(parts - whole).max() <= tol * scale
    assert h_last.shape == (NL, 2, D, N) and conv_tail.shape == (NL, 2, D, K - 1)
    assert h_last.dtype == conv_tail.dtype == dtype
    assert np.abs(h_w - h_last).max() <= tol * max(np.abs(h_last).max(), 1)
    assert np.abs(c_w - conv_tail).max() <= tol * max(np.abs(conv_tail).max(), 1)
    # without return_state the plain result; a zero state given equals none given
    np.testing.assert_array_equal(model_forward(tok, p, discretization=discretization), whole)
    zeros = model_forward(tok, p, h0=np.zeros_like(h_last), conv_state=np.zeros_like(conv_tail),
                          discretization=discretization)
    np.testing.assert_array_equal(zeros, whole)


def test_windows_match_the_float64_reference_with_carried_state():
    p, tok = _params(np.float64), _tokens(seed=1)
    ours, _ = _windowed(tok, p)
    hs = [None] * NL
    cs = [None] * NL                  # the reference's conv_state layout is (B, K-1, D)
    emb = p["embedding"]
    outs, t = [], 0
    for w in WINDOWS:
        x = emb[tok[:, t:t + w]]
        for i in range(NL):
            x, hs[i], cs[i] = ref.block_forward(x, ref.block_params_of_layer(p, i), h0=hs[i],
                                                conv_state=cs[i], return_state=True)
        xn = ref.rmsnorm(x, p["final_norm"], 1e-6)
        outs.append(ref.linear_forward(xn, emb, p["lm_head_bias"]))
        t += w
    want = np.concatenate(outs, axis=1)
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-12 * np.abs(want).max())


def test_loss_and_grads_with_carried_state_is_truncated_bptt():
    p, tok = _params(np.float64), _tokens(L=40, seed=2)
    tgt = np.roll(tok, -1, axis=1)
    _, (h, c) = model_forward(tok[:, :30], p, return_state=True)
    win, wtgt = tok[:, 30:], tgt[:, 30:]
    loss, grads, (h2, c2) = model_loss_and_grads(win, wtgt, p, h0=h, conv_state=c, return_state=True)
    logits, (h3, c3) = model_forward(win, p, h0=h, conv_state=c, return_state=True)
    assert abs(loss - ref.cross_entropy_forward(logits, wtgt)) <= 1e-12 * loss
    np.testing.assert_array_equal(h2, h3)
    np.testing.assert_array_equal(c2, c3)
    # the state is used: without it the loss and the gradients differ
    loss0, grads0 = model_loss_and_grads(win, wtgt, p)
    assert abs(loss0 - loss) > 1e-6
    assert not np.allclose(grads0["layer0.wInProj"], grads["layer0.wInProj"])
    # checkpointing recomputes with the same state: bit-identical gradients
    loss_c, grads_c = model_loss_and_grads(win, wtgt, p, True, h0=h, conv_state=c)
    assert loss_c == loss and all(np.array_equal(grads_c[k], grads[k]) for k in grads)
    # the gradient is d(window loss)/d(param) with h0, conv_state held constant
    rng = np.random.default_rng(3)
    for name in ("layer0.wConv", "layer1.bDtProj", "layer2.A_log", "embedding"):
        idx = tuple(rng.integers(0, s) for s in p[name].shape)
        e = 1e-6
        f = []
        for sgn in (1, -1):
            q = {k: v.copy() for k, v in p.items()}
            q[name][idx] += sgn * e
            f.append(model_loss_and_grads(win, wtgt, q, h0=h, conv_state=c)[0])
        fd = (f[0] - f[1]) / (2 * e)
        assert abs(fd - grads[name][idx]) <= 1e-6 * max(abs(fd), 1e-3), name


def test_state_arguments_are_checked():
    p, tok = _params(np.float32), _tokens(L=5)
    with pytest.raises(ValueError, match="h0"):
        model_forward(tok, p, h0=np.zeros((NL, 2, D, N + 1), np.float32))
    with pytest.raises(ValueError, match="conv_state"):
        model_forward(tok, p, conv_state=np.zeros((NL - 1, 2, D, K - 1), np.float32))
    with pytest.raises((TypeError, ValueError), match="h0"):
        model_loss_and_grads(tok, tok, p, h0=np.zeros((NL, 2, D, N), np.float64))
    # an empty window passes the state through
    h = np.random.default_rng(0).standard_normal((NL, 2, D, N)).astype(np.float32)
    logits, (h_last, _) = model_forward(tok[:, :0], p, h0=h, return_state=True)
    assert logits.shape == (2, 0, V)
    np.testing.assert_array_equal(h_last, h)
