"""State passing of mamba1_forward / mamba1_backward (h0, conv_state, return_state).

A long sequence processed in chunks (each chunk gets the previous chunk's final scan state
and conv tail) must give the outputs and the gradients of one piece: params summed over
the chunks, dx concatenated, backprop through the chunks in reverse with dh_last /
dconv_tail = the next chunk's grads["h0"] / grads["conv_state"].
"""
from __future__ import annotations

import numpy as np
import pytest

from mamba_ext import init_model_params, mamba1_backward, mamba1_forward
from mamba_ext.block import init_mamba1_params
from mamba_ext import recurrent

DISCS = ["zoh", "euler"]


def _params(dtype, d_model=12, d_state=5, d_conv=4, seed=0):
    p = init_mamba1_params(d_model, d_state=d_state, d_conv=d_conv, seed=seed, dtype=np.float64)
    rng = np.random.default_rng(seed + 1)
    # non-trivial biases and conv taps, so every path carries signal
    for n in ("bInProj", "bConv", "bXProj", "bDtProj", "bOutProj"):
        p[n] = rng.normal(0, 0.1, p[n].shape)
    p["wConv"] = rng.normal(0, 0.5, p["wConv"].shape)
    p["wInProj"] = rng.normal(0, 0.3, p["wInProj"].shape)
    p["wXProj"] = rng.normal(0, 0.3, p["wXProj"].shape)
    return {k: np.ascontiguousarray(v, dtype=dtype) for k, v in p.items()}


def _state_inputs(p, B, L, dtype, seed=3):
    rng = np.random.default_rng(seed)
    D, K = p["wConv"].shape
    N = p["A_log"].shape[1]
    Dm = p["wInProj"].shape[1]
    x = rng.normal(0, 1, (B, L, Dm)).astype(dtype)
    h0 = rng.normal(0, 0.5, (B, D, N)).astype(dtype)
    cs = rng.normal(0, 0.5, (B, D, K - 1)).astype(dtype)
    dout = rng.normal(0, 1, (B, L, Dm)).astype(dtype)
    dh_last = rng.normal(0, 1, (B, D, N)).astype(dtype)
    dtail = rng.normal(0, 1, (B, D, K - 1)).astype(dtype)
    return x, h0, cs, dout, dh_last, dtail


def _chunked(x, p, h0, cs, dout, dh_last, dtail, bounds, disc):
    """Forward chunk by chunk with state, backward in reverse; returns the same as one piece."""
    outs, caches, state = [], [], (h0, cs)
    for a, b in zip(bounds[:-1], bounds[1:]):
        o, c, state = mamba1_forward(x[:, a:b], p, h0=state[0], conv_state=state[1],
                                     return_state=True, discretization=disc)
        outs.append(o)
        caches.append(c)
    dxs, total = [], None
    g_h, g_c = dh_last, dtail
    for i in range(len(caches) - 1, -1, -1):
        a, b = bounds[i], bounds[i + 1]
        dx, g = mamba1_backward(dout[:, a:b], p, caches[i], dh_last=g_h, dconv_tail=g_c)
        g_h, g_c = g["h0"], g["conv_state"]
        dxs.insert(0, dx)
        total = g if total is None else {k: total[k] + g[k] for k in total}
    total["h0"], total["conv_state"] = g_h, g_c          # those of the first chunk
    return np.concatenate(outs, axis=1), state, np.concatenate(dxs, axis=1), total


@pytest.mark.parametrize("disc", DISCS)
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-11), (np.float32, 2e-4)])
def test_chunks_equal_one_piece(disc, dtype, rtol):
    p = _params(dtype)
    B, L = 2, 150                      # K-1 = 3; chunks of 2 and 1 (< K-1), 70 and 77 (not
    bounds = [0, 2, 3, 73, 150]        # multiples of SCAN_CHUNK = 64)
    x, h0, cs, dout, dh_last, dtail = _state_inputs(p, B, L, dtype)
    out, cache, (hL, tail) = mamba1_forward(x, p, h0=h0, conv_state=cs, return_state=True,
                                            discretization=disc)
    dx, g = mamba1_backward(dout, p, cache, dh_last=dh_last, dconv_tail=dtail)
    out_c, (hL_c, tail_c), dx_c, g_c = _chunked(x, p, h0, cs, dout, dh_last, dtail, bounds, disc)

    def close(name, a, b):
        scale = max(np.abs(b).max(), 1e-30)
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale, err_msg=name)

    close("out", out_c, out)
    close("h_last", hL_c, hL)
    close("conv_tail", tail_c, tail)
    close("dx", dx_c, dx)
    assert set(g_c) == set(g) and {"h0", "conv_state"} <= set(g)
    for k in g:
        close(k, g_c[k], g[k])
    assert np.abs(g["h0"]).max() > 0 and np.abs(g["conv_state"]).max() > 0


def test_conv_tail_is_xc_of_the_last_steps():
    """conv_tail = in_proj x-half of the last K-1 steps; with L < K-1, the rest from conv_state."""
    p = _params(np.float64)
    D, K = p["wConv"].shape
    for L in (1, 2, 5):
        x, h0, cs, *_ = _state_inputs(p, 2, L, np.float64)
        _, _, (_, tail) = mamba1_forward(x, p, conv_state=cs, return_state=True)
        xn = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * p["normWeight"]
        xc = (xn @ p["wInProj"].T + p["bInProj"])[:, :, :D]          # (B, L, D)
        hist = np.concatenate([cs, xc.transpose(0, 2, 1)], axis=2)   # (B, D, K-1+L) oldest first
        np.testing.assert_allclose(tail, hist[:, :, -(K - 1):], rtol=1e-12, atol=1e-14)


def test_default_return_and_no_state_grads():
    p = _params(np.float64)
    x, h0, cs, dout, *_ = _state_inputs(p, 1, 9, np.float64)
    res = mamba1_forward(x, p)
    assert len(res) == 2
    _, g = mamba1_backward(dout, p, res[1])
    assert "h0" not in g and "conv_state" not in g
    out_h, c_h = mamba1_forward(x, p, h0=h0)
    _, g_h = mamba1_backward(dout, p, c_h)
    assert "h0" in g_h and "conv_state" not in g_h
    assert not np.allclose(out_h, res[0])                 # h0 changes the output
    # zeros as state == no state, bitwise
    z_out, _ = mamba1_forward(x, p, h0=np.zeros_like(h0), conv_state=np.zeros_like(cs))
    np.testing.assert_array_equal(z_out, res[0])


def _fd(f, a, eps=1e-6):
    g = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        old = a[i]
        a[i] = old + eps
        fp = f()
        a[i] = old - eps
        fm = f()
        a[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


@pytest.mark.parametrize("disc", DISCS)
def test_state_gradients_finite_differences(disc):
    p = _params(np.float64, d_model=6, d_state=3, d_conv=4)
    B, L = 2, 5
    x, h0, cs, dout, dh_last, dtail = _state_inputs(p, B, L, np.float64, seed=7)

    def loss():
        out, _, (hL, tail) = mamba1_forward(x, p, h0=h0, conv_state=cs, return_state=True,
                                            discretization=disc)
        return np.sum(out * dout) + np.sum(hL * dh_last) + np.sum(tail * dtail)

    _, cache, _ = mamba1_forward(x, p, h0=h0, conv_state=cs, return_state=True,
                                 discretization=disc)
    dx, g = mamba1_backward(dout, p, cache, dh_last=dh_last, dconv_tail=dtail)
    for name, arr, ana in (("h0", h0, g["h0"]), ("conv_state", cs, g["conv_state"]),
                           ("x", x, dx), ("wConv", p["wConv"], g["wConv"]),
                           ("A_log", p["A_log"], g["A_log"])):
        num = _fd(loss, arr)
        np.testing.assert_allclose(ana, num, rtol=1e-6, atol=1e-8, err_msg=name)


def test_bad_state_shapes_and_dtypes():
    p = _params(np.float64)
    D, K = p["wConv"].shape
    N = p["A_log"].shape[1]
    x, h0, cs, dout, *_ = _state_inputs(p, 2, 7, np.float64)
    with pytest.raises(ValueError, match="h0"):
        mamba1_forward(x, p, h0=np.zeros((2, D, N + 1)))
    with pytest.raises(ValueError, match="h0"):
        mamba1_forward(x, p, h0=np.zeros((1, D, N)))
    with pytest.raises(ValueError, match="conv_state"):
        mamba1_forward(x, p, conv_state=np.zeros((2, D, K)))
    with pytest.raises(ValueError, match="conv_state"):
        mamba1_forward(x, p, conv_state=np.zeros((2, D)))
    with pytest.raises(TypeError, match="h0"):
        mamba1_forward(x, p, h0=h0.astype(np.float32))
    _, cache = mamba1_forward(x, p, h0=h0)
    with pytest.raises(ValueError, match="dh_last"):
        mamba1_backward(dout, p, cache, dh_last=np.zeros((2, D + 1, N)))
    with pytest.raises(ValueError, match="dconv_tail"):
        mamba1_backward(dout, p, cache, dconv_tail=np.zeros((2, D, K + 1)))


def test_empty_chunk_passes_state_through():
    p = _params(np.float64)
    x, h0, cs, _, dh_last, dtail = _state_inputs(p, 2, 0, np.float64)
    out, cache, (hL, tail) = mamba1_forward(x, p, h0=h0, conv_state=cs, return_state=True)
    assert out.shape == x.shape
    np.testing.assert_array_equal(hL, h0)
    np.testing.assert_array_equal(tail, cs)
    _, g = mamba1_backward(np.zeros_like(x), p, cache, dh_last=dh_last, dconv_tail=dtail)
    np.testing.assert_array_equal(g["h0"], dh_last)
    np.testing.assert_array_equal(g["conv_state"], dtail)


@pytest.mark.parametrize("disc", DISCS)
def test_recurrent_step_agrees_with_forward_state(disc):
    """After feeding tokens one by one with recurrent.step, every layer's state equals
    mamba1_forward(return_state=True) of that layer on the whole prefix; and step()
    continued from the forward's state gives the logits of step() all the way."""
    V, Dm, n_layers = 32, 8, 2
    params = init_model_params(V, Dm, n_layers, d_state=4, seed=1, dtype=np.float64)
    layers = [{k[len(f"layer{i}."):]: v for k, v in params.items() if k.startswith(f"layer{i}.")}
              for i in range(n_layers)]
    rng = np.random.default_rng(0)
    toks = rng.integers(0, V, (2, 11))
    eps = 1e-6
    st = recurrent.init_state(params, 2, eps=eps, discretization=disc)
    for t in range(toks.shape[1]):
        logits, st = recurrent.step(toks[:, t], params, st)
    x = params["embedding"][toks[:, :-1]]                 # prefix of 10 tokens
    st2 = recurrent.init_state(params, 2, eps=eps, discretization=disc)
    for i, lp in enumerate(layers):
        x, _, (h, tail) = mamba1_forward(x, lp, return_state=True, eps=eps, discretization=disc)
        st2.h[i][...] = h
        st2.conv[i][...] = tail
    logits2, st2 = recurrent.step(toks[:, -1], params, st2)
    np.testing.assert_allclose(logits2, logits, rtol=1e-10, atol=1e-12)
    for i in range(n_layers):
        np.testing.assert_allclose(st2.h[i], st.h[i], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(st2.conv[i], st.conv[i], rtol=1e-10, atol=1e-12)
