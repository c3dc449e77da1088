"""GPU benchmark (``python -m mamba_ext bench --device gpu``): WGSL forward+backward of one block.

For each size (``--size a|b|c|all``, shapes of ``mamba_ext.bench.sizes.SIZES``):

* WGSL fwd+bwd median over ``--repeat`` runs: GPU time from timestamp queries
  around the one compute pass holding all dispatches (when the adapter has
  ``timestamp-query``), and wall-clock time per step with the queue drained
  (one pass: encoded, submitted, waited for);
* wall-clock time per pass of ``--repeat`` (at least 10) passes back to back, each
  encoded while the GPU runs the one before (as ``ResidentTrainer`` runs training
  steps), the queue drained once at the end: the wall clock a training loop sees
  per pass, the measure comparable to CUDA events around a PyTorch step (their
  interval also holds the launches' host time wherever the GPU waits for it);
* GPU memory held by our buffers for that size;
* the scan kernels alone (3 forward + 5 backward dispatches): their time, the
  bytes they must move (each input read once, each output written once) and
  the achieved bandwidth, against a copy kernel measured in the same run and
  the nominal ~4 TB/s of an H200;
* when torch with CUDA imports: PyTorch eager float32 implementations of the
  same block timed with CUDA events in the same process — (1) the Python loop
  over time (``mamba_ext.testing.torch_block.block_forward``) and (2) a chunked one
  without a Python time loop (``block_forward_chunked``: log-space cumulative sums of
  delta*A inside chunks of 16 steps and a Hillis-Steele scan across chunks), both with
  autograd backward
  — their agreement with the WGSL result and the ratios.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank, M = B*L.
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np

from .._validate import BlockDims
from ..constants import DEFAULT_EPS
from ..gpu.device import gpu
from .sizes import SIZES, TRAIN_STEPS

NOMINAL_BW = 4.0e12   # bytes/s, H200 device copy as measured through wgpu (issue 4)


def init_params(Dm, D, N, K, R, seed=0):
    """Random block weights of the realistic-init kind (golden README)."""
    rng = np.random.default_rng(seed)
    P = R + 2 * N
    f = lambda *s, sd=1.0: (rng.standard_normal(s) * sd).astype(np.float32)
    return {
        "wInProj": f(2 * D, Dm, sd=Dm ** -0.5), "bInProj": f(2 * D, sd=0.1),
        "wConv": f(D, K, sd=(0.81 / K) ** 0.5), "bConv": f(D, sd=0.1),
        "wXProj": f(P, D, sd=D ** -0.5), "bXProj": f(P, sd=0.1),
        "wDtProj": f(D, R, sd=(0.25 / R) ** 0.5),
        "bDtProj": rng.uniform(-4.0, -2.0, D).astype(np.float32),
        "A_log": np.log(np.tile(np.arange(1, N + 1, dtype=np.float32), (D, 1))),
        "D_vec": np.ones(D, np.float32), "wOutProj": f(Dm, D, sd=D ** -0.5),
        "bOutProj": f(Dm, sd=0.1), "normWeight": np.ones(Dm, np.float32),
    }


def scan_bytes(d: BlockDims, B, L, T, parts):
    """Compulsory bytes of the 8 scan dispatches (see kernels/scan.wgsl); ``parts``: the
    dBs/dCs partials of scan_backward_grads (ScanShape.parts)."""
    M, D, N = B * L, d.D, d.N
    MD, MN, CN = M * D, M * N, B * math.ceil(L / T) * D * N
    words = ((2 * MD + MN + 2 * CN)            # fwd_local
             + 3 * CN                          # fwd_carry
             + (3 * MD + 2 * MN + CN)          # fwd_out
             + (2 * MD + MN + CN)              # bwd_local
             + 3 * CN                          # bwd_carry
             + (6 * MD + 2 * MN + 3 * CN + parts * M * 2 * N)   # bwd_grads
             + (parts * M * 2 * N + M * 2 * N)     # reduce_bc
             + (CN + 2 * D * N))               # reduce_da
    return 4 * words


def _time_ops(g, ops, clears, repeat, warmup=2, warmup_s=0.0):
    """(GPU ms median or None, wall ms median) of one pass with ``ops``, after ``warmup``
    passes and at least ``warmup_s`` seconds of them (short passes timed after two warm-up
    passes ran up to 5x slower on an H200 than after half a second of them:
    docs/gpu_h200.txt, session 19)."""
    ts = g.timestamp_pair()
    t0 = time.perf_counter()
    done = 0
    while done < warmup or time.perf_counter() - t0 < warmup_s:
        g.submit(ops, clears)
        g.sync()
        done += 1
    g.sync()
    gpu_ms, wall_ms = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        g.submit(ops, clears, timestamps=ts)
        g.sync()
        wall_ms.append((time.perf_counter() - t0) * 1e3)
        if ts is not None:
            t = g.read(ts[1], 2, np.uint64)
            gpu_ms.append((int(t[1]) - int(t[0])) * 1e-6)   # Vulkan/wgpu ticks: ns
    med = statistics.median
    return (med(gpu_ms) if gpu_ms else None), med(wall_ms)


def _back_to_back_ms(g, ops, clears, repeat, rounds=3):
    """Wall ms per pass of ``repeat`` passes submitted back to back, the next one encoded
    while the GPU runs this one (the first encoded before the clock starts, as a steady
    training loop has it), the queue drained at the end; median of ``rounds``."""
    per = []
    for _ in range(rounds):
        g.sync()
        cb = g.encode(ops, clears)
        t0 = time.perf_counter()
        for i in range(repeat):
            g.submit_encoded(cb)
            if i + 1 < repeat:
                cb = g.encode(ops, clears)
        g.sync()
        per.append((time.perf_counter() - t0) * 1e3 / repeat)
    return statistics.median(per)


def copy_bandwidth(g, n_floats=1 << 26, repeat=5):
    """Bytes/s of the copy_vec4 kernel on ``n_floats`` floats (read + write)."""
    from ..gpu.device import elementwise
    n = min(n_floats, g.max_binding // 4) // 4 * 4
    a, b = g.buffer(n, "bw_src"), g.buffer(n, "bw_dst")
    op = elementwise(g, "selftest", "copy_vec4", n // 4, [n // 4], [a, b])
    gpu_ms, wall_ms = _time_ops(g, [op], (), repeat)
    ms = gpu_ms if gpu_ms is not None else wall_ms
    a.destroy()
    b.destroy()
    return 8.0 * n / (ms * 1e-3)


# ------------------------------------------------------------------ torch
def torch_bench(x, params, dout, ref_out, ref_dx, repeat, loops):
    """Rows (name, ms, agreement) of the PyTorch CUDA implementations."""
    try:
        import torch
    except ImportError:
        return [], "torch not importable"
    if not torch.cuda.is_available():
        return [], "torch has no CUDA device"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    tx = torch.tensor(x, device=dev, requires_grad=True)
    tp = {k: torch.tensor(v, device=dev, requires_grad=True) for k, v in params.items()}
    td = torch.tensor(dout, device=dev)
    from ..testing import torch_block
    impls = [("torch chunked (no time loop)", torch_block.block_forward_chunked)]
    if loops:
        impls.append(("torch Python time loop", torch_block.block_forward))
    rows = []
    for name, fn in impls:
        def run(fn=fn):
            tx.grad = None
            for v in tp.values():
                v.grad = None
            out = fn(tx, tp)
            out.backward(td)
            return out
        n = repeat if "chunked" in name else max(2, min(repeat, 5))
        for _ in range(2):
            out = run()
        torch.cuda.synchronize()
        ms = []
        for _ in range(n):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = run()
            e1.record()
            torch.cuda.synchronize()
            ms.append(e0.elapsed_time(e1))
        err_o = float((out.detach().cpu().numpy() - ref_out).__abs__().max() / np.abs(ref_out).max())
        err_d = float((tx.grad.cpu().numpy() - ref_dx).__abs__().max() / np.abs(ref_dx).max())
        rows.append((name, statistics.median(ms), max(err_o, err_d)))
        torch.cuda.empty_cache()
    return rows, ""


def bench_size(size, repeat, use_torch, loops, profile=False, discretization="zoh", amp=False):
    from ..gpu import linear, scan
    from ..gpu.block import BlockPlan
    Dm, D, N, K, R, B, L = SIZES[size]
    g = gpu()
    dims = BlockDims(Dm=Dm, D=D, N=N, K=K, R=R)
    params = init_params(Dm, D, N, K, R)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, Dm)).astype(np.float32)
    dout = rng.standard_normal((B, L, Dm)).astype(np.float32)
    before = g.bytes_allocated
    plan = BlockPlan(dims, B, L, DEFAULT_EPS, discretization, scan.layout_key(), f16=amp)
    mem = g.bytes_allocated - before
    from .._validate import BLOCK_PARAM_NAMES
    plan.upload_params({k: params[k] for k in BLOCK_PARAM_NAMES})
    g.write(plan.x, x)
    g.write(plan.dout, dout)
    ops = plan.fwd + plan.bwd
    gpu_ms, wall_ms = _time_ops(g, ops, [plan.gr], repeat)
    b2b_ms = _back_to_back_ms(g, ops, [plan.gr], max(repeat, 10))
    out = g.read(plan.out, x.size).reshape(x.shape)
    dx = g.read(plan.dx, x.size).reshape(x.shape)
    lay = plan.layer
    scan_ops = [op for op in ops if op.name.startswith("scan_")]
    scan_gpu, scan_wall = _time_ops(g, scan_ops, [], repeat)
    sb = scan_bytes(dims, B, L, lay.s.chunk, lay.s.parts)
    res = dict(size=size, dims=(Dm, D, N, K, R, B, L), gpu_ms=gpu_ms, wall_ms=wall_ms, b2b_ms=b2b_ms, mem=mem,
               scan_ms=scan_gpu if scan_gpu is not None else scan_wall, scan_bytes=sb,
               n_dispatch=len(ops), chunk=lay.s.chunk, tile=linear.GEMM_TILE)
    if profile:
        # Each dispatch alone in its own pass (timestamps around it), summed by kernel name.
        per = {}
        for op in ops:
            t, w = _time_ops(g, [op], [], 3, warmup=1)
            per.setdefault(op.name, []).append(t if t is not None else w)
        res["profile"] = sorted(((sum(v), len(v), k) for k, v in per.items()), reverse=True)
        M, P = B * L, R + 2 * N
        res["gemm_flop"] = 6.0 * M * (Dm * 2 * D + D * P + R * D + D * Dm)
    res["torch"], res["torch_note"] = (torch_bench(x, params, dout, out, dx, repeat, loops)
                                       if use_torch else ([], "skipped (--no-torch)"))
    return res


def train_step(name, steps=5, warmup=2, checkpointing=False, discretization="zoh", amp=False):
    """Whole-model training step of ``TRAIN_STEPS[name]`` (byte-level LM: embedding,
    blocks, final norm, tied head, cross-entropy, grad norm, AdamW in one submit,
    mamba_ext.gpu.ResidentTrainer, with activation checkpointing when asked): median
    wall ms per step with the loss read back, tokens/s, the same pipelined (each step
    submitted before the one before it is read back, ResidentTrainer.step_async, as
    ``train --device gpu`` runs: wall over ``steps`` steps / steps), and the GPU memory of our
    buffers (allocated for this model; a device-wide scratch buffer that an earlier
    model of the same process already allocated large enough is not counted again).
    ``amp``: mixed precision (a DynamicLossScaler; the tensor-core products where the
    device has them, ResidentTrainer.products says)."""
    from ..amp import DynamicLossScaler
    from ..gpu.trainer import ResidentTrainer
    from ..model import init_model_params
    V, Dm, nl, B, L = TRAIN_STEPS[name]
    g = gpu()
    params = init_model_params(V, Dm, nl, seed=0)
    before = g.bytes_allocated
    tr = ResidentTrainer(params, lr=1e-4, checkpointing=checkpointing,
                         discretization=discretization,
                         scaler=DynamicLossScaler() if amp else None)
    products = tr.products(B, L) if amp else "fp32 WGSL"
    tok = np.random.default_rng(0).integers(0, V, (B, L + 1))
    x, y = tok[:, :-1], tok[:, 1:]
    for _ in range(warmup):
        tr.step(x, y)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = tr.step(x, y)
        ts.append(time.perf_counter() - t0)
    ms = statistics.median(ts) * 1e3
    # pipelined, as train --device gpu runs: each step submitted before the one before it
    # is read back (ResidentTrainer.step_async); wall per step over `steps` steps
    tr.step_async(x, y).result()
    t0 = time.perf_counter()
    pending = None
    for _ in range(steps):
        nxt = tr.step_async(x, y)
        if pending is not None:
            pending.result()
        pending = nxt
    pending.result()
    ms_pipe = (time.perf_counter() - t0) * 1e3 / steps
    mem = g.bytes_allocated - before
    skipped = tr.skipped
    del tr
    return dict(name=name, cfg=(V, Dm, nl, B, L), ms=ms, tokens_s=B * L / ms * 1e3, mem=mem,
                products=products, skipped=skipped,
                loss=loss, ms_pipelined=ms_pipe, tokens_s_pipelined=B * L / ms_pipe * 1e3)


def fp32_products(g, name: str) -> str:
    """``name`` of the fp32 path, and what it multiplies with on ``g`` where that is the
    split f16 products (mamba_ext.gpu.linear_split), for the benches' lines."""
    from ..gpu import linear_split
    return (f"{name} (products that fit as three f16 products of split operands)"
            if linear_split.active(g) else name)


def run_train_steps(names, steps=5, checkpointing=False, discretization="zoh", amp=False) -> int:
    """Print one line per model of ``names`` (keys of TRAIN_STEPS); returns 0."""
    g = gpu()
    print(f"adapter: {g.info.get('device')} ({g.info.get('backend_type')})")
    fp32 = fp32_products(g, "fp32 WGSL")
    for n in names:
        r = train_step(n, steps, checkpointing=checkpointing, discretization=discretization,
                       amp=amp)
        V, Dm, nl, B, L = r["cfg"]
        what = (f"AMP ({r['products']}; {r['skipped']} steps skipped by the loss scaler)"
                if amp else fp32)
        print(f"model V {V}, {nl} layers x d_model {Dm}, B {B} x L {L}, {what}"
              f"{', checkpointing' if checkpointing else ''}"
              f"{', Euler' if discretization == 'euler' else ''}: step "
              f"{r['ms']:.2f} ms = {r['tokens_s']:,.0f} tokens/s (wall, median of {steps}, loss "
              f"read back), GPU memory {r['mem'] / 2**20:.0f} MiB, loss {r['loss']:.4f}; "
              f"pipelined (the next step submitted before this one's loss is read back, as "
              f"train runs): {r['ms_pipelined']:.2f} ms = {r['tokens_s_pipelined']:,.0f} "
              f"tokens/s", flush=True)
    return 0


def run(size: str = "all", *, repeat: int = 10, use_torch: bool = True, loops: bool = True,
        profile: bool = False, discretization: str = "zoh", amp: bool = False) -> int:
    """Run the GPU benchmark for ``size`` ("a" .. "d", or "all" = a, b, c) and print its tables;
    returns 0. ``use_torch``: also time the PyTorch CUDA baselines; ``loops``: include
    the slow Python-time-loop one; ``profile``: also time every dispatch alone;
    ``discretization``: "zoh" (the package default) or "euler" (b_bar = Delta*B, as
    mamba_ssm's kernel computes; its PyTorch baselines here are ZOH, so not with them);
    ``amp``: the linear layers on tensor cores (f16 operands; the device must have
    f16 subgroup matrices, mamba_ext.gpu.linear_f16), the rest in f32."""
    if repeat < 1:
        raise ValueError(f"repeat: expected an integer >= 1, got {repeat!r}")
    if discretization != "zoh" and use_torch:
        raise ValueError("discretization: the PyTorch baselines of this bench compute ZOH; "
                         "bench Euler without them (use_torch=False)")
    g = gpu()
    if amp:
        from ..gpu import linear_f16
        if not linear_f16.available(g):
            raise RuntimeError("amp: this device offers no f16 subgroup matrices (they need "
                               "MAMBA_EXT_GPU_BACKEND=dawn on a GPU that has them)")
    info = g.info
    print(f"adapter: {info.get('device')} ({info.get('backend_type')}, {info.get('adapter_type')}); "
          f"timestamp-query: {g.timestamps}; max storage binding {g.max_binding} B")
    bw = copy_bandwidth(g)
    print(f"copy kernel bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    sizes = ["a", "b", "c"] if size == "all" else [size]
    print(f"discretization: {discretization}; products: "
          f"{'linear layers f16 on tensor cores (AMP)' if amp else fp32_products(g, 'fp32')}")
    print("\n| size | Dm,D,N,K,R,B,L | WGSL fwd+bwd GPU ms | wall ms | wall ms back to back | "
          "GPU mem MiB | scan ms | scan GB/s | scan / copy bw | scan / 4 TB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for s in sizes:
        r = bench_size(s, repeat, use_torch, loops, profile, discretization, amp)
        results.append(r)
        sbw = r["scan_bytes"] / (r["scan_ms"] * 1e-3)
        gms = f"{r['gpu_ms']:.3f}" if r["gpu_ms"] is not None else "n/a"
        print(f"| {s} | {','.join(map(str, r['dims']))} | {gms} | {r['wall_ms']:.3f} | {r['b2b_ms']:.3f} | "
              f"{r['mem'] / 2**20:.1f} | {r['scan_ms']:.3f} | {sbw / 1e9:.0f} | {sbw / bw:.2f} | "
              f"{sbw / NOMINAL_BW:.2f} |", flush=True)
    for r in results:
        ours = r["gpu_ms"] if r["gpu_ms"] is not None else r["wall_ms"]
        print(f"\nsize {r['size']}: {r['n_dispatch']} dispatches in one pass, scan chunk "
              f"{r['chunk']}, GEMM tile {r['tile'][0]}x{r['tile'][1]}; "
              f"WGSL fwd+bwd {ours:.3f} ms")
        for tot, cnt, name in r.get("profile", []):
            extra = ""
            if name in ("linear_forward", "linear_backward"):
                # the block's forward GEMMs are 1/3 of gemm_flop, the backward's 2/3
                flop = r["gemm_flop"] * (1 / 3 if name == "linear_forward" else 2 / 3)
                extra = f"  ({flop / (tot * 1e-3) / 1e12:.1f} TFLOP/s)"
            print(f"  kernel {name:32s} x{cnt:2d} {tot:8.3f} ms{extra}")
        if not r["torch"]:
            print(f"  PyTorch CUDA baselines: {r['torch_note']}")
        for name, ms, err in r["torch"]:
            print(f"  {name:32s} {ms:9.3f} ms  (max err vs WGSL {err:.1e})  "
                  f"torch/WGSL = {ms / ours:.2f}x")
        if r["torch"]:
            best = min(r["torch"], key=lambda t: t[1])
            print(f"  fastest PyTorch ({best[0]}) / WGSL = {best[1] / ours:.2f}x")
    return 0


# The products of block d's in_proj and out_proj (M = B*L = 16384, Dm 768, D 1536) that
# ``--f16-gemm`` times: (name, M, I, O) of Y (M, O) = X (M, I) W (O, I)^T.
F16_GEMM_SHAPES = (("in_proj", 16384, 768, 3072), ("out_proj", 16384, 1536, 768))
# seconds of each product's passes before ``--f16-gemm`` times it (:func:`_time_ops`)
WARMUP_S = 0.5


def check_f16_products(g, lf, rng):
    """Max relative error of forward / dinput / dweight (written, then accumulated), and
    of forward from a bias, against float64 products of the same f16-rounded inputs;
    "start value": that forward with X = 0 against the bias (0.0 when exact)."""
    M, I, O = 256, 384, 128
    x, w, dy = (rng.standard_normal(s).astype(np.float16) for s in ((M, I), (O, I), (M, O)))
    bx, bw, bdy = (lf.f16_buffer(g, a, n) for a, n in ((x, "f16_x"), (w, "f16_w"), (dy, "f16_dy")))
    bxt, bwt = lf.f16_buffer(g, x.T, "f16_xt"), lf.f16_buffer(g, w.T, "f16_wt")
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    errs = {}
    for name, fn, args, shape, want in (
            ("forward", lf.forward, (bx, bwt), (M, O), x64 @ w64.T),
            ("dinput", lf.dinput, (bdy, bw), (M, I), dy64 @ w64),
            ("dweight", lf.dweight, (bxt, bdy), (O, I), dy64.T @ x64)):
        c0 = rng.standard_normal(shape).astype(np.float32)
        for acc in (False, True):
            c = g.buffer(c0.size, "f16_c", c0)
            g.submit(fn(g, c, *args, M, I, O, accumulate=acc))
            got = g.read(c, c0.size).reshape(shape).astype(np.float64)
            ref = want + (c0 if acc else 0)
            errs[f"{name}{'+=' if acc else ''}"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    # forward starting from a bias, and that start alone (x = 0): exactly the bias
    b0 = rng.standard_normal(O + 5).astype(np.float32)
    bb = g.buffer(b0.size, "f16_bias", b0)
    for name, xb, want in (("forward+bias", bx, x64 @ w64.T + b0[5:]),
                           ("start value", lf.f16_buffer(g, np.zeros((M, I)), "f16_x0"),
                            np.broadcast_to(b0[5:].astype(np.float64), (M, O)))):
        c = g.buffer(M * O, "f16_c")
        g.submit(lf.forward(g, c, xb, bwt, M, I, O, bias=(bb, 5)))
        got = g.read(c, M * O).reshape(M, O).astype(np.float64)
        errs[name] = float(np.abs(got - want).max() / np.abs(want).max())
    # a contraction long enough to be split over K (linear_f16.dweight_splits), accumulated
    Ms = 4 * lf.SPLIT_MIN_K
    dys, xs = (rng.standard_normal(s).astype(np.float16) for s in ((Ms, O), (Ms, I)))
    c0 = rng.standard_normal((O, I)).astype(np.float32)
    c = g.buffer(c0.size, "f16_c", c0)
    g.submit(lf.dweight(g, c, lf.f16_buffer(g, xs.T, "f16_xst"), lf.f16_buffer(g, dys, "f16_dys"),
                        Ms, I, O))
    got = g.read(c, c0.size).reshape(O, I).astype(np.float64)
    ref = dys.astype(np.float64).T @ xs.astype(np.float64) + c0
    errs[f"dweight+= in {lf.dweight_splits(Ms, I, O)} K slices"] = float(
        np.abs(got - ref).max() / np.abs(ref).max())
    errs.update(check_narrow_f16_products(g, lf, rng))
    return errs


def check_split_products(g, rng, M=256, I=384, O=128):
    """Max |got - float64| / max |float64| of the fp32 products run split on the tensor
    cores (mamba_ext.gpu.linear_split, through linear.gemm, linear_forward and
    linear_backward): a forward, one from the bias with a residual, dX added to and dW with
    db added to, on f32 inputs of mixed magnitudes (each product's ops checked to be the
    split ones)."""
    from ..gpu import linear as lin
    f = lambda *s, sd=1.0: (rng.standard_normal(s) * sd).astype(np.float32)    # noqa: E731
    x, w, b, res = f(M, I, sd=3.0), f(O, I, sd=0.02), f(O), f(M, O)
    dy, dx0 = f(M, O, sd=1e-6), f(M, I, sd=1e-8)
    arena = np.concatenate([w.ravel(), b])
    gr0 = f(arena.size, sd=1e-5)
    bx, bw, bres, bdy = (g.buffer(a.size, n, a) for a, n in
                         ((x, "sp_x"), (arena, "sp_w"), (res, "sp_res"), (dy, "sp_dy")))
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    y, dx, gr = g.buffer(M * O, "sp_y"), g.buffer(dx0.size, "sp_dx", dx0), g.buffer(gr0.size, "sp_gr", gr0)
    runs = (("forward", lin.gemm(g, "linear_forward", M, O, I, lin.Mat(bx, 0, I),
                                 lin.Mat(bw, 0, 1, I), lin.Mat(y, 0, O)), y, (M, O), x64 @ w64.T),
            ("forward+bias+res", lin.linear_forward(g, M, I, O, bx, 0, I, bw, 0, w.size, y, 0, O,
                                                    res=bres), y, (M, O), x64 @ w64.T + b + res),
            ("dinput+=", lin.gemm(g, "linear_backward", M, I, O, lin.Mat(bdy, 0, O),
                                  lin.Mat(bw, 0, I), lin.Mat(dx, 0, I), beta=1), dx, (M, I),
             dy64 @ w64 + dx0),
            ("dweight+= db", lin.linear_backward(g, M, I, O, bdy, 0, O, bx, 0, I, bw, 0, w.size,
                                                 gr), gr, (arena.size,),
             gr0 + np.concatenate([(dy64.T @ x64).ravel(), dy64.sum(0)])))
    errs = {}
    for name, ops, buf, shape, want in runs:
        if not any(op.name == "linear_split_pack" for op in ops):
            raise RuntimeError(f"check_split_products: {name} did not run split")
        g.submit(ops)
        got = g.read(buf, int(np.prod(shape))).reshape(shape).astype(np.float64)
        errs[name] = float(np.abs(got - want).max() / np.abs(want).max())
    for bf in (bx, bw, bres, bdy, y, dx, gr):
        bf.destroy()
    return errs


def check_narrow_f16_products(g, lf, rng):
    """The narrow products of x_proj and dt_proj (linear_f16.product's n_valid, on operands
    zero-padded to whole tiles): a forward from a bias with 48 of its 128 columns stored,
    and weight gradients with 48 columns, row-major and transposed (C_COLMAJOR), split over
    K and accumulated; max relative error against float64 of the same f16 values."""
    M, I, O, Np = 256, 384, 48, 128
    x = rng.standard_normal((M, I)).astype(np.float16)
    w = np.zeros((Np, I), np.float16)
    w[:O] = rng.standard_normal((O, I))
    b0 = rng.standard_normal(O + 5).astype(np.float32)
    errs = {}
    c = g.buffer(M * O, "f16_c")
    g.submit([lf.product(g, c, lf.f16_buffer(g, x, "f16_x"), lf.f16_buffer(g, w, "f16_w"), M,
                         Np, I, a_kmajor=True, b_kmajor=True, lda=I, ldb=I, ldc=O,
                         bias=(g.buffer(b0.size, "f16_bias", b0), 5), n_valid=O)])
    want = x.astype(np.float64) @ w[:O].astype(np.float64).T + b0[5:]
    got = g.read(c, M * O).reshape(M, O)
    errs["narrow forward+bias"] = float(np.abs(got - want).max() / np.abs(want).max())
    # dW (O, I) += dY^T X over Ms rows: dY (Ms, Np) zero past O, X^T (I, Ms)
    Ms = 4 * lf.SPLIT_MIN_K
    dy = np.zeros((Ms, Np), np.float16)
    dy[:, :O] = rng.standard_normal((Ms, O))
    xs = rng.standard_normal((Ms, I)).astype(np.float16)
    full = dy[:, :O].astype(np.float64).T @ xs.astype(np.float64)       # (O, I)
    bdy, bxt = lf.f16_buffer(g, dy, "f16_dyp"), lf.f16_buffer(g, xs.T, "f16_xst")
    c0 = rng.standard_normal((O, I)).astype(np.float32)
    c = g.buffer(c0.size, "f16_c", c0)
    g.submit(lf.weight_product(g, c, 0, I, Np, Ms, bxt, bdy, b_kmajor=False, ldb=Np,
                               n_valid=O, c_colmajor=True))
    got, ref = g.read(c, c0.size).reshape(O, I), full + c0
    S = lf.dweight_splits(Ms, Np, I)
    errs[f"narrow dW^T+= in {S} K slices"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    # dW (I, O) += X^T dY: I rows, O of Np columns, row-major
    c0 = rng.standard_normal((I, O)).astype(np.float32)
    c = g.buffer(c0.size, "f16_c", c0)
    g.submit(lf.weight_product(g, c, 0, I, Np, Ms, bxt, bdy, b_kmajor=False, ldb=Np, n_valid=O))
    got, ref = g.read(c, c0.size).reshape(I, O), full.T + c0
    errs[f"narrow dW+= in {S} K slices"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    return errs


def f16_loss_and_grads(g, arrays, dims, tok, tgt, f16: bool, checkpointing=False,
                       loss_scale: float = 1.0):
    """(loss, grads) of the model ``arrays`` on one batch, on the GPU, with the blocks'
    products on the f16 kernels (``f16``) or on the f32 ones; the gradients computed
    ``loss_scale`` times larger and divided by it (a power of two: exact in f32), as
    mixed-precision training runs them so that small gradients stay normal f16 values."""
    from ..gpu.block import half_weights
    from ..gpu.device import arena_layout
    from ..gpu.model import ModelPlan
    order = list(arrays)
    offs, n = arena_layout([(k, arrays[k].shape) for k in order])
    w = g.buffer(n, "params", np.concatenate([arrays[k].ravel() for k in order]))
    half = half_weights(g, w, offs, {k: a.shape for k, a in arrays.items()}) if f16 else None
    plan = ModelPlan(arrays, dims, *tok.shape, order, w=w, f16=half,
                     checkpointing=checkpointing)
    ops = plan.train_ops()
    plan.upload_batch(tok, tgt)
    plan.set_loss_scale(loss_scale)
    g.submit(ops, plan.clears)
    grads = plan.read_tensors(plan.gr, arrays)
    return plan.loss(), {k: v / np.float32(loss_scale) for k, v in grads.items()}


def check_f16_model(g, rng, Dm=256, n_layers=2, B=2, L=128) -> dict:
    """Loss and gradients of a small model (weights f16 values, V 256, d_inner 2 Dm) with
    the blocks' products on the f16 kernels (mamba_ext.gpu.linear_f16; at Dm 256 x_proj's
    and dt_proj's too) against the f32 products on the same weights, both with the loss
    scaled by 2^12 as mixed-precision training scales it (dt_proj's gradients, ~1e-5 here,
    would otherwise fall into f16's subnormals): {"loss": relative difference, "grads":
    the largest max|diff| / max|f32| over the parameters}. They differ by the f16 rounding
    of the products' operands, ~1e-3."""
    from ..gpu.model import check_model
    from ..model import init_model_params
    p = init_model_params(256, Dm, n_layers, seed=int(rng.integers(1 << 30)))
    arrays, dims = check_model({k: v.astype(np.float16).astype(np.float32) for k, v in p.items()})
    tok, tgt = rng.integers(0, 256, (B, L)), rng.integers(0, 256, (B, L))
    (l32, g32), (l16, g16) = (f16_loss_and_grads(g, arrays, dims, tok, tgt, f16,
                                                 loss_scale=2.0 ** 12)
                              for f16 in (False, True))
    err = lambda a, b: float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    return {"loss": abs(l16 - l32) / abs(l32), "grads": max(err(g16[k], g32[k]) for k in arrays)}


def run_f16_gemm(repeat: int = 10) -> int:
    """``bench --device gpu --f16-gemm``: the tensor-core products of kernels/linear_f16.wgsl
    (f16 operands, f32 accumulation) on block d's in_proj and out_proj shapes, forward,
    dX and dW, in TFLOP/s from timestamp queries (median of ``repeat`` passes of 5
    products each), after a check of every layout against float64; then the fp32
    kernel of linear.wgsl on the same forward products. Needs a device with f16
    subgroup matrices (MAMBA_EXT_GPU_BACKEND=dawn); returns 1 without one."""
    from ..gpu import linear as lin
    from ..gpu import linear_f16 as lf
    from ..gpu import linear_split as ls
    g = gpu()
    print(f"adapter: {g.info.get('device')} ({g.backend.NAME}, checks {g.checks}); subgroup size "
          f"{g.subgroup_size}; f16 subgroup matrices {g.f16_matrices}", flush=True)
    if not lf.available(g):
        print("no f16 subgroup matrices on this device: run with MAMBA_EXT_GPU_BACKEND=dawn on a "
              "GPU that has them")
        return 1
    _, M, I, O = F16_GEMM_SHAPES[0]
    tile = lf.tile_for(g, M, O, I)
    cfg, wm, wn = lf.plan(g, tile)
    print(f"kernel tile {tile[0]} x {tile[1]}, BK {tile[2]}, {tile[3]} invocations: "
          f"subgroup matrices {cfg['m']}x{cfg['n']}x{cfg['k']}, {wm} x {wn} subgroups",
          flush=True)
    rng = np.random.default_rng(0)
    errs = check_f16_products(g, lf, rng)
    print("check, max |got - float64| / max |float64|: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
    if ls.active(g):
        errs = check_split_products(g, rng)
        print("check of the split fp32 products, max |got - float64| / max |float64|: "
              + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
    reps = 5
    for name, M, I, O in F16_GEMM_SHAPES:
        x, w, dy, xt, wt = (lf.f16_buffer(g, rng.standard_normal(s).astype(np.float16), n)
                            for s, n in (((M, I), "x"), ((O, I), "w"), ((M, O), "dy"),
                                         ((I, M), "xt"), ((I, O), "wt")))
        y, dx, dw = g.buffer(M * O, "y"), g.buffer(M * I, "dx"), g.buffer(O * I, "dw")
        flop = 2.0 * M * I * O
        line = []
        for kind, ops in (("forward", lf.forward(g, y, x, wt, M, I, O)),
                          ("dX", lf.dinput(g, dx, dy, w, M, I, O)),
                          ("dW", lf.dweight(g, dw, xt, dy, M, I, O))):
            gpu_ms, wall_ms = _time_ops(g, ops * reps, (), repeat, warmup_s=WARMUP_S)
            ms = (gpu_ms if gpu_ms is not None else wall_ms) / reps
            line.append(f"{kind} {ms:.3f} ms = {flop / ms / 1e9:.1f} TFLOP/s")
        print(f"f16 {name} (M {M}, I {I}, O {O}): " + "; ".join(line), flush=True)
        for b in (x, w, dy, xt, wt, y, dx, dw):
            b.destroy()
        # fp32 products, same shapes: linear.wgsl's kernel, then split into three f16
        # products (linear_split; their TFLOP/s count the fp32 product's 2 M I O)
        x32, w32, dy32 = (g.buffer(n, nm, rng.standard_normal(n).astype(np.float32))
                          for n, nm in ((M * I, "x32"), (O * I, "w32"), (M * O, "dy32")))
        y32, dx32, dw32 = g.buffer(M * O, "y32"), g.buffer(M * I, "dx32"), g.buffer(O * I, "dw32")
        saved = ls.ENABLED
        try:
            for label, enabled in (("fp32 linear.wgsl", False), ("fp32 split, 3 x f16", None)):
                ls.ENABLED = enabled
                if not ls.active(g) and enabled is None:
                    continue
                line = []
                for kind, ops in (
                        ("forward", lin.gemm(g, "linear_forward", M, O, I, lin.Mat(x32, 0, I),
                                             lin.Mat(w32, 0, 1, I), lin.Mat(y32, 0, O))),
                        ("dX", lin.gemm(g, "linear_backward", M, I, O, lin.Mat(dy32, 0, O),
                                        lin.Mat(w32, 0, I), lin.Mat(dx32, 0, I))),
                        ("dW", lin.gemm(g, "linear_backward", O, I, M, lin.Mat(dy32, 0, 1, O),
                                        lin.Mat(x32, 0, I), lin.Mat(dw32, 0, I), beta=1))):
                    gpu_ms, wall_ms = _time_ops(g, ops * reps, (), repeat, warmup_s=WARMUP_S)
                    ms = (gpu_ms if gpu_ms is not None else wall_ms) / reps
                    line.append(f"{kind} {ms:.3f} ms = {flop / ms / 1e9:.1f} TFLOP/s")
                print(f"{label} {name}: " + "; ".join(line), flush=True)
        finally:
            ls.ENABLED = saved      # as it was, whatever happened while timing
        for b in (x32, w32, dy32, y32, dx32, dw32):
            b.destroy()
    return 0
