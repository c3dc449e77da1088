"""kernels/scan.wgsl (mamba_ext.gpu.scan) alone: forward against the float64
reference step reference.scan_forward, backward against central finite
differences of it in float64 (every element for small sizes, random directions
for larger ones); the A_log clamp; run-to-run determinism."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import f32, nerr, optional_hardware, read, require_gpu, run, subgroup_layout, upload
from mamba_ext.constants import A_LOG_MAX, A_LOG_MIN
from mamba_ext.testing import reference

g = require_gpu()
from mamba_ext.gpu import scan as S  # noqa: E402


@pytest.fixture(autouse=True, params=["default", "wg32-small-blocks", "subgroup-sums"])
def scan_mode(request, monkeypatch):
    """Every test in three layouts: the default one (the module's: subgroup sums where
    scan.SCAN_SUBGROUP_SUMS and scan.subgroup_sums allow); 32 invocations with staged
    blocks of 4 steps (forward: more blocks and partial blocks per chunk; backward: longer
    blocks than the default's 2), two reduction rounds of 2 steps a block, one partial of
    the dBs/dCs sums per workgroup (the default has two), the sums through workgroup memory;
    and the subgroup sums at the subgroup size this device's subgroups have
    (gpu_support.subgroup_layout: lavapipe's 8, NVIDIA's 32), also where the adapter does
    not state it."""
    if request.param == "wg32-small-blocks":
        monkeypatch.setattr(S, "SCAN_SUM_PARTS", 1)
        monkeypatch.setattr(S, "SCAN_WG", 32)
        monkeypatch.setattr(S, "SCAN_TS_FORWARD", 4)
        monkeypatch.setattr(S, "SCAN_TS_BACKWARD", 4)
        monkeypatch.setattr(S, "SCAN_RB", 2)
        monkeypatch.setattr(S, "SCAN_SUBGROUP_SUMS", False)
    elif request.param == "subgroup-sums":
        size = subgroup_layout(g)
        if size not in S.SUBGROUP_SIZES:
            optional_hardware(f"subgroup sums: this device's subgroups (size {size}) are "
                              f"not of a size in {S.SUBGROUP_SIZES} laid out in order")
        monkeypatch.setattr(g, "subgroup_size", size)
        monkeypatch.setattr(S, "SCAN_SUBGROUP_SUMS", True)
    return request.param


def make_case(B, L, D, N, R, seed, a_log=(-2.0, 1.5)):
    """float32 inputs of one scan: xproj (M, P), u, delta_pre (M, D), A_log (D, N),
    D_vec (D,), dy (M, D)."""
    rng = np.random.default_rng(seed)
    M, P = B * L, R + 2 * N
    return dict(xproj=f32(rng, M, P), u=f32(rng, M, D),
                delta_pre=rng.uniform(-3.0, 1.0, (M, D)).astype(np.float32),
                A_log=rng.uniform(*a_log, (D, N)).astype(np.float32),
                D_vec=(1 + 0.5 * rng.standard_normal(D)).astype(np.float32), dy=f32(rng, M, D))


def delta_of(delta_pre):
    """delta = softplus(delta_pre) in float64, rounded to float32 (the scan kernels compute
    it in float32 from delta_pre, within rounding of this)."""
    return reference.softplus(delta_pre.astype(np.float64)).astype(np.float32)


def gpu_scan(c, B, L, D, N, R, chunk, disc):
    """Run the scan forward and backward on the GPU; returns the outputs as arrays."""
    M, P = B * L, R + 2 * N
    s = S.ScanShape(B, L, D, N, R, chunk, disc == "zoh", sub=S.subgroup_sums(g, N))
    o = {"A_log": 1, "D_vec": 1 + D * N}
    arena = np.concatenate([[7.0], c["A_log"].ravel(), c["D_vec"]]).astype(np.float32)
    bw = upload(g, "w", arena)
    bq, bu, bdp, bdy = (upload(g, k, c[k]) for k in ("xproj", "u", "delta_pre", "dy"))
    n = s.chunk_elems
    hchunk, achunk, hstate = g.buffer(n, "hchunk"), g.buffer(n, "achunk"), g.buffer(n, "hstate")
    y, du, ddp = g.buffer(M * D, "y"), g.buffer(M * D, "du"), g.buffer(M * D, "ddelta_pre")
    dxproj0 = np.full((M, P), 3.0, np.float32)
    dxproj = upload(g, "dxproj", dxproj0)
    gr = g.buffer(arena.size, "gr")
    run(g, [*S.scan_forward(g, s, bq, bu, bdp, bw, o, hchunk, achunk, hstate, y),
            *S.scan_backward(g, s, S.ScanScratch(g, s), bq, bu, bdp, bw, o, bdy, hstate,
                             achunk, du, ddp, dxproj, gr)])
    grad = read(g, gr, (arena.size,))
    return dict(y=read(g, y, (M, D)), du=read(g, du, (M, D)), ddelta_pre=read(g, ddp, (M, D)),
                dxproj=read(g, dxproj, (M, P)), A_log=grad[1:1 + D * N].reshape(D, N),
                D_vec=grad[1 + D * N:], untouched=grad[0])


def ref_loss(c, B, L, D, N, R, disc, **over):
    """float64 sum(dy * y) of reference.scan_forward, with entries of ``over`` replacing
    the inputs (u, delta_pre, Bs, Cs, A_log, D_vec)."""
    v = {k: np.asarray(a, np.float64) for k, a in c.items()}
    Bs = v["xproj"][:, R:R + N]
    Cs = v["xproj"][:, R + N:]
    inp = dict(u=v["u"], delta_pre=v["delta_pre"], Bs=Bs, Cs=Cs, A_log=v["A_log"], D_vec=v["D_vec"])
    inp.update(over)
    sh = lambda a, w: a.reshape(B, L, w)
    y, _ = reference.scan_forward(sh(inp["u"], D), sh(reference.softplus(inp["delta_pre"]), D),
                                  reference.a_of(inp["A_log"]), sh(inp["Bs"], N), sh(inp["Cs"], N),
                                  inp["D_vec"], disc)
    return float(np.sum(y.reshape(B * L, D) * v["dy"]))


def fd_grads(c, B, L, D, N, R, disc, eps=1e-6):
    """Every element of every input gradient by central differences in float64."""
    v = {k: np.asarray(a, np.float64) for k, a in c.items()}
    base = dict(u=v["u"], delta_pre=v["delta_pre"], Bs=v["xproj"][:, R:R + N],
                Cs=v["xproj"][:, R + N:], A_log=v["A_log"], D_vec=v["D_vec"])
    out = {}
    for name, a in base.items():
        gr = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            hi, lo = a.copy(), a.copy()
            hi[i] += eps
            lo[i] -= eps
            gr[i] = (ref_loss(c, B, L, D, N, R, disc, **{name: hi})
                     - ref_loss(c, B, L, D, N, R, disc, **{name: lo})) / (2 * eps)
        out[name] = gr
    return out


def forward_ref(c, B, L, D, N, R, disc):
    v = {k: np.asarray(a, np.float64) for k, a in c.items()}
    sh = lambda a, w: a.reshape(B, L, w)
    y, _ = reference.scan_forward(sh(v["u"], D), sh(delta_of(c["delta_pre"]).astype(np.float64), D),
                                  reference.a_of(v["A_log"]), sh(v["xproj"][:, R:R + N], N),
                                  sh(v["xproj"][:, R + N:], N), v["D_vec"], disc)
    return y.reshape(B * L, D)


# (B, L, D, N, R, chunk, discretization): L not a multiple of the chunk; N not a
# divisor of the workgroup; one chunk of 1 step; the default chunk.
# dState above 16: two and three state groups per channel. Chunks of 2 steps: 23 chunks (46
# per batch of two), past the four chunks the carries take at once and the 32 rows the dA_log
# sum's lanes take at once.
SMALL = [(2, 7, 3, 4, 2, 3, "zoh"), (1, 5, 2, 3, 1, 1, "euler"), (3, 4, 5, 1, 1, 4, "zoh"),
         (1, 6, 3, 20, 2, 4, "zoh")]
LARGE = [(2, 70, 40, 16, 3, S.SCAN_CHUNK, "zoh"), (1, 129, 33, 5, 2, 64, "euler"),
         (3, 45, 130, 7, 4, 13, "zoh"), (2, 50, 9, 40, 3, 32, "zoh"), (1, 33, 5, 17, 2, 64, "euler"),
         (2, 45, 9, 4, 2, 2, "zoh")]


@pytest.mark.parametrize("cfg", SMALL + LARGE, ids=lambda c: "-".join(map(str, c)))
def test_scan_forward(cfg):
    B, L, D, N, R, chunk, disc = cfg
    c = make_case(B, L, D, N, R, seed=sum(cfg[:6]))
    got = gpu_scan(c, B, L, D, N, R, chunk, disc)
    assert nerr(got["y"], forward_ref(c, B, L, D, N, R, disc)) <= 2e-5


@pytest.mark.parametrize("cfg", SMALL, ids=lambda c: "-".join(map(str, c)))
def test_scan_backward_every_element(cfg):
    B, L, D, N, R, chunk, disc = cfg
    c = make_case(B, L, D, N, R, seed=sum(cfg[:6]))
    got = gpu_scan(c, B, L, D, N, R, chunk, disc)
    fd = fd_grads(c, B, L, D, N, R, disc)
    # FD error ~1e-9 here; float32 sums ~1e-6 of the largest value
    assert nerr(got["du"], fd["u"]) <= 1e-4
    assert nerr(got["ddelta_pre"], fd["delta_pre"]) <= 1e-4
    assert nerr(got["dxproj"][:, R:R + N], fd["Bs"]) <= 1e-4
    assert nerr(got["dxproj"][:, R + N:], fd["Cs"]) <= 1e-4
    assert nerr(got["A_log"], fd["A_log"]) <= 1e-4
    assert nerr(got["D_vec"], fd["D_vec"]) <= 1e-4
    assert np.all(got["dxproj"][:, :R] == 3.0)      # dt_low columns are dt_proj's
    assert got["untouched"] == 0.0


@pytest.mark.parametrize("cfg", LARGE, ids=lambda c: "-".join(map(str, c)))
def test_scan_backward_directional(cfg):
    """<grad, v> against (f(x + e v) - f(x - e v)) / 2e for a random v per input."""
    B, L, D, N, R, chunk, disc = cfg
    c = make_case(B, L, D, N, R, seed=sum(cfg[:6]))
    got = gpu_scan(c, B, L, D, N, R, chunk, disc)
    v64 = {k: np.asarray(a, np.float64) for k, a in c.items()}
    base = dict(u=v64["u"], delta_pre=v64["delta_pre"], Bs=v64["xproj"][:, R:R + N],
                Cs=v64["xproj"][:, R + N:], A_log=v64["A_log"], D_vec=v64["D_vec"])
    ours = dict(u=got["du"], delta_pre=got["ddelta_pre"], Bs=got["dxproj"][:, R:R + N],
                Cs=got["dxproj"][:, R + N:], A_log=got["A_log"], D_vec=got["D_vec"])
    rng = np.random.default_rng(0)
    e = 1e-6
    for name, a in base.items():
        v = rng.standard_normal(a.shape)
        fd = (ref_loss(c, B, L, D, N, R, disc, **{name: a + e * v})
              - ref_loss(c, B, L, D, N, R, disc, **{name: a - e * v})) / (2 * e)
        dot = float(np.sum(ours[name].astype(np.float64) * v))
        scale = float(np.sum(np.abs(ours[name].astype(np.float64) * v)))
        assert abs(dot - fd) <= 1e-4 * scale, (name, dot, fd, scale)


def test_scan_a_log_clamp_gradient_exactly_zero():
    B, L, D, N, R = 2, 9, 4, 3, 1
    c = make_case(B, L, D, N, R, seed=3)
    c["A_log"][0, :] = [A_LOG_MIN, A_LOG_MIN - 1, A_LOG_MAX]
    c["A_log"][1, :] = [A_LOG_MAX + 2, -20.0, 7.0]
    got = gpu_scan(c, B, L, D, N, R, 4, "zoh")
    assert np.all(got["A_log"][:2] == 0.0)
    assert np.all(got["A_log"][2:] != 0.0)
    # and the clamp itself is the reference's: y agrees with the float64 step
    assert nerr(got["y"], forward_ref(c, B, L, D, N, R, "zoh")) <= 2e-5


def test_scan_clamp_bounds_come_from_python():
    """kernels/scan.wgsl gets A_LOG_MIN/A_LOG_MAX as override constants; no literal bound."""
    from mamba_ext.gpu.device import kernel_source
    src = kernel_source("scan")
    assert "override a_log_min: f32;" in src and "override a_log_max: f32;" in src
    assert "-10.0" not in src and "5.0)" not in src
    assert S.scan_constants(32)["a_log_min"] == A_LOG_MIN
    assert S.scan_constants(32)["a_log_max"] == A_LOG_MAX


def test_scan_extreme_delta_pre():
    """delta = softplus(delta_pre) is computed in the kernels: far in either tail (delta
    below float32's normal range; delta = delta_pre) the forward still matches."""
    B, L, D, N, R = 2, 21, 6, 4, 2
    c = make_case(B, L, D, N, R, seed=5)
    c["delta_pre"][:, 0] = -100.0
    c["delta_pre"][:, 1] = 30.0
    got = gpu_scan(c, B, L, D, N, R, 8, "zoh")
    assert nerr(got["y"], forward_ref(c, B, L, D, N, R, "zoh")) <= 2e-5
    assert np.all(np.isfinite(got["ddelta_pre"])) and np.all(np.isfinite(got["du"]))


def test_scan_deterministic():
    cfg = (2, 70, 40, 16, 3, S.SCAN_CHUNK, "zoh")
    c = make_case(*cfg[:5], seed=1)
    a, b = gpu_scan(c, *cfg), gpu_scan(c, *cfg)
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("L", [8, 40])
def test_scan_passes(L):
    """One chunk: the chunk pass alone (its y is all of y); more: three."""
    s = S.ScanShape(2, L, 8, 4, 1, 8, True)
    bufs = [g.buffer(4, "b") for _ in range(7)]
    ops = S.scan_forward(g, s, *bufs[:4], {"A_log": 0, "D_vec": 0}, *bufs[4:7], g.buffer(4, "y"))
    assert [op.name for op in ops] == (["scan_forward_chunk"] if L <= 8 else
                                       ["scan_forward_chunk", "scan_forward_carry",
                                        "scan_forward_correct"])


@pytest.mark.parametrize("N, SG, NV", [(1, 1, 1), (5, 1, 2), (16, 1, 4), (17, 2, 4), (40, 3, 4),
                                       (512, 32, 4)])
def test_scan_layout(N, SG, NV):
    """State groups of 16 per invocation, workgroup memory within WebGPU's 16 KiB,
    the chunk bounded by the backward kernel's checkpoints."""
    s = S.ScanShape(1, 100, 64, N, 2, 64, True)
    assert (s.SG, s.NV) == (SG, NV)
    assert s.wg % s.SG == 0 and s.cpw * s.SG == s.wg
    assert 4 * (2 * s.ts_b * 32 * s.SG + s.rb * s.wg * 35) <= 16384    # two staged blocks
    assert 4 * (2 * s.ts_f * 32 * s.SG + s.ts_f * s.wg) <= 16384
    assert max(s.ts_b, s.ts_f) * 32 * s.SG <= 32 * s.wg        # BCMAX floats per invocation
    assert s.ts_b % s.rb == 0 and s.chunk <= 32 * s.ts_b
    big = S.ScanShape(1, 100, 64, N, 2, 64, True, wg_memory=49152)    # a larger device limit
    assert big.ts_b >= s.ts_b and big.rb >= s.rb and big.chunk >= s.chunk


def test_staged_blocks_held_to_the_kernels_arrays(monkeypatch):
    """SCAN_TS_FORWARD above the kernels' TSMAX (8) is held to it: scan_backward_chunk stages
    blocks of that many steps' inputs in private arrays of TSMAX, and read past them with
    16 (dev/gpu/scan_sweep.py on an H200: results 15% off). The same bits as with 8."""
    B, L, D, N, R = 2, 100, 64, 16, 4
    c = make_case(B, L, D, N, R, seed=11)
    monkeypatch.setattr(S, "SCAN_TS_FORWARD", 8)
    want = gpu_scan(c, B, L, D, N, R, 64, "zoh")
    ts_b = S.SCAN_TS_BACKWARD                     # the mode's
    monkeypatch.setattr(S, "SCAN_TS_FORWARD", 16)
    monkeypatch.setattr(S, "SCAN_TS_BACKWARD", 16)
    s = S.ScanShape(B, L, D, N, R, 64, True)
    assert s.ts_f == 8 and s.ts_b <= 8
    monkeypatch.setattr(S, "SCAN_TS_BACKWARD", ts_b)
    got = gpu_scan(c, B, L, D, N, R, 64, "zoh")
    for k, v in want.items():
        assert np.array_equal(np.asarray(got[k]).view(np.uint32), np.asarray(v).view(np.uint32)), k


def test_scan_refuses_huge_state():
    with pytest.raises(ValueError, match="dState"):
        S.ScanShape(1, 4, 2, 4096, 1, 8, True)


def test_scan_chunk_limits():
    with pytest.raises(ValueError, match="chunk"):
        S.ScanShape(1, 4, 2, 2, 1, S.SCAN_CHUNK_MAX + 1, True)
    with pytest.raises(ValueError, match="chunk"):
        S.ScanShape(1, 4, 2, 2, 1, 0, True)
