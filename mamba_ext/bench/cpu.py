"""CPU benchmark (``python -m mamba_ext bench``): forward+backward time and memory of one block.

For each size: the median over ``--repeat`` runs of ``mamba1_forward`` +
``mamba1_backward`` (after warm-up: one call, and SETTLE_S seconds of work in the process),
tokens/s (B*L / median), the
process's peak RSS (``ru_maxrss``; measured before torch is imported) and the
cache bytes. Then, in the same process:

* the bound: GEMM FLOPs of forward+backward (6*M*C*OC per linear) at the faster of
  two GEMM rates of the in_proj shape, a NumPy matmul and the core's own product
  (``mamba_ext.cpu.linear.product``: its GEMM, BLAS or AVX-512, and its threads), plus the scan's 2*B*L*D*N
  exponentials (one per state element in the forward, one when the backward
  recomputes it) at the exp rate of NumPy float32 exp on as many threads as
  our kernels use (both rates the best of several runs); ours/bound (and
  backward/forward) is the median of BOUND_ROUNDS rounds, each timing ours and then the
  bound right after it (the machine's speed drifts: a ratio of two things measured
  minutes apart is not a ratio of the same machine);
* when torch imports: the median of a PyTorch eager autograd implementation of
  the same block (``mamba_ext.testing.torch_block``) on the same inputs (the faster of torch's
  default thread count and 1 thread), its agreement with ours, and the ratio
  torch/ours.

``--device gpu`` runs ``mamba_ext.bench.gpu`` instead; ``--generation`` runs
``mamba_ext.bench.generation``.

Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank, M = B*L.
"""
from __future__ import annotations

import math
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .sizes import SIZES


def blas_config() -> str | None:
    """SciPy's BLAS as it describes itself (OpenBLAS: version, build and the kernel set
    its CPU detection picked, e.g. "OpenBLAS 0.3.30 DYNAMIC_ARCH NO_AFFINITY Haswell
    MAX_THREADS=64"), or None where it cannot be asked (not OpenBLAS): the library that
    csrc/mx_blas.h binds for the core's products."""
    from ..cpu import linear
    return linear.blas_config() or None


def blas_note(config: str | None, cpu_flags, gemm: str = "blas") -> str | None:
    """A line for the bench when ``config`` (:func:`blas_config`) names none of
    OpenBLAS's AVX-512 kernel sets (``mamba_ext.cpu.linear.AVX512_CORES``, the list
    ``set_gemm("auto")`` decides by) on a CPU whose flags (``cpu_flags``) include AVX-512,
    else None: its run-time detection fell back on a CPU it does not know (an AMD Zen 5
    in a VM, docs/performance.md); ``gemm``: the core's float32 GEMM
    (``mamba_ext.cpu.linear.gemm_kernel()``)."""
    from ..cpu.linear import AVX512_CORES
    if config is None or "avx512f" not in cpu_flags:
        return None
    if any(core in config.lower().split() for core in AVX512_CORES):
        return None
    if gemm == "avx512":
        return (f"BLAS: SciPy's {config}: kernels without AVX-512 on a CPU with it, so the "
                f"core's products run mamba_ext's AVX-512 sgemm instead "
                f"(mamba_ext.cpu.linear.set_gemm); NumPy's own matmul keeps those kernels "
                f"unless the launcher sets OPENBLAS_CORETYPE=SKYLAKEX before Python starts "
                f"(docs/performance.md, the BLAS's kernels)")
    return (f"BLAS: SciPy's {config}: kernels without AVX-512 on a CPU with it; "
            f"OPENBLAS_CORETYPE=SKYLAKEX, set by the launcher before Python starts, may run "
            f"its sgemm up to 2x faster (docs/performance.md, the BLAS's kernels)")


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def peak_rss_mib() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # kilobytes on Linux
    return kb / 1024 if sys.platform != "darwin" else kb / 2 ** 20


# seconds of benchmark work a process does before a call of ours or of the baseline is
# timed: a process runs its first second of work slower (the exp rate rose from 2.5 to
# 5.3 G/s over it, and the 2 x 64 step timed from its second call read 22.5 ms where child
# processes timing a second of calls read 19.0, session 21); a training loop runs settled
SETTLE_S = 1.0
_work_start = None      # perf_counter() of this process's first timed benchmark call


def _median_time(fn, repeat, give_up=math.inf, stat=statistics.median, settle_s=0.0):
    """``stat`` (median) of ``repeat`` timed calls after one warm-up call (first-touch,
    thread pools) and, until this process has done ``settle_s`` seconds of benchmark work,
    more of them; inf if the first exceeds give_up s."""
    global _work_start
    t0 = time.perf_counter()
    if _work_start is None:
        _work_start = t0
    fn()
    if time.perf_counter() - t0 > give_up:
        return math.inf
    while time.perf_counter() - _work_start < settle_s:
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return stat(times)


def make_inputs(size, dtype, seed=0):
    from ..block import init_mamba1_params
    Dm, D, N, K, R, B, L = SIZES[size]
    params = init_mamba1_params(Dm, d_state=N, d_conv=K, expand=D // Dm, dt_rank=R, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, L, Dm)).astype(dtype)
    dout = rng.standard_normal((B, L, Dm)).astype(dtype)
    return x, params, dout


def bench_ours(size, dtype, repeat, n_threads, settle_s=None):
    """Median seconds of fwd+bwd and of the forward of ``size`` (timed once the process has
    done ``settle_s``, default SETTLE_S, seconds of benchmark work), with the run's outputs,
    peak RSS and cache MiB."""
    from ..block import mamba1_backward, mamba1_forward
    settle = SETTLE_S if settle_s is None else settle_s
    x, params, dout = make_inputs(size, dtype)
    state = {}

    def step():
        out, cache = mamba1_forward(x, params, n_threads=n_threads)
        dx, grads = mamba1_backward(dout, params, cache)
        state.update(out=out, dx=dx, grads=grads, cache_bytes=cache.nbytes)

    t = _median_time(step, repeat, settle_s=settle)
    # forward alone, for the split
    t_fwd = _median_time(lambda: mamba1_forward(x, params, n_threads=n_threads), repeat,
                         settle_s=settle)
    return dict(t=t, t_fwd=t_fwd, rss=peak_rss_mib(), cache_mib=state["cache_bytes"] / 2 ** 20,
                out=state["out"], dx=state["dx"], grads=state["grads"])


def _one_thread_time(size, dtype, repeat):
    """Median fwd+bwd seconds of ``size`` in a child process on one thread (OpenMP and the
    BLAS both limited by their environment variables before they start)."""
    import os
    import subprocess
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               BLIS_NUM_THREADS="1")
    code = (f"from mamba_ext.bench.cpu import bench_ours; "
            f"print(bench_ours({size!r}, {np.dtype(dtype).name!r}, {int(repeat)}, 1, "
            f"{SETTLE_S!r})['t'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def gemm_flops(size):
    """Forward (2*M*C*OC) + backward (dinput and dweight, 4*M*C*OC) of the four linears."""
    Dm, D, N, K, R, B, L = SIZES[size]
    M, P = B * L, R + 2 * N
    return 6 * M * (Dm * 2 * D + D * P + R * D + D * Dm)


def machine_rates(M, Dm, D, repeat, cores):
    """(GEMM FLOP/s, exp/s, what the GEMM rate is) measured in this process: the faster of
    a NumPy float32 matmul of the in_proj shape (M, Dm) x (Dm, 2D) and the core's own
    product of that shape on ``cores`` threads (where the core runs a GEMM of its own,
    NumPy's BLAS would understate what the machine does), both into one preallocated
    output, and NumPy float32 exp on ``cores`` threads; the best of the runs (a busy
    moment only makes them look slower)."""
    from ..cpu import linear
    rng = np.random.default_rng(1)
    a = rng.standard_normal((M, Dm), dtype=np.float32)
    w = rng.standard_normal((Dm, 2 * D), dtype=np.float32)
    wt = np.ascontiguousarray(w.T)
    out = np.empty((M, 2 * D), np.float32)
    flop = 2 * M * Dm * 2 * D
    # the core's first: NumPy's BLAS threads spin on after its matmul returns, and timed
    # right after it the core's product ran at half its rate in some processes (session 19)
    core_rate = flop / _median_time(lambda: linear.product(a, wt, n_threads=cores, out=out),
                                    max(repeat, 10), stat=min)
    numpy_rate = flop / _median_time(lambda: np.matmul(a, w, out=out), max(repeat, 10), stat=min)
    sgemm_rate = max(numpy_rate, core_rate)
    what = (f"the faster of NumPy's matmul, {numpy_rate / 1e9:.0f}, and the core's product "
            f"({linear.gemm_kernel()} GEMM), {core_rate / 1e9:.0f}")
    # exp on as many cores as our scan uses (it is parallel over (batch, channel))
    chunk = [-rng.random(1 << 20, dtype=np.float32) for _ in range(cores)]
    outs = [np.empty_like(c) for c in chunk]
    with ThreadPoolExecutor(cores) as pool:
        def all_cores():
            list(pool.map(lambda i: [np.exp(chunk[i], out=outs[i]) for _ in range(4)], range(cores)))
        # the rate rises over the first second or so of this work in a process (measured:
        # 2.5 G/s, then 5.3 G/s on 2 cores): time it once it has settled
        t_end = time.perf_counter() + 1.0
        while time.perf_counter() < t_end:
            all_cores()
        t_exp = _median_time(all_cores, max(repeat, 20), stat=min)
    return sgemm_rate, cores * 4 * (1 << 20) / t_exp, what


def measure_bound(size, repeat, cores):
    """(bound seconds, GEMM FLOP/s, exp/s, what the GEMM rate is) measured in this process;
    both rates on ``cores`` threads."""
    Dm, D, N, K, R, B, L = SIZES[size]
    sgemm_rate, exp_rate, what = machine_rates(B * L, Dm, D, repeat, cores)
    n_exp = 2 * B * L * D * N
    return gemm_flops(size) / sgemm_rate + n_exp / exp_rate, sgemm_rate, exp_rate, what


# rounds of ours-then-the-bound behind each ours/bound figure: the two measured right after
# each other, their ratio per round, the median of the rounds' ratios (this 2-core machine's
# speed drifts by 20-40% over minutes, so a ratio of two things measured minutes apart
# moved from 1.20 to 1.44 between runs of the same code: docs/performance.md, session 23)
BOUND_ROUNDS = 3


def interleaved_ratio(ours, bound, rounds=BOUND_ROUNDS):
    """(median of ours() / bound() over ``rounds`` rounds, [(ours s, bound s)] per round):
    each round times ours (a median of its own) and, right after, the bound."""
    runs = []
    for _ in range(rounds):
        t = ours()
        runs.append((t, bound()))
    return statistics.median(t / b for t, b in runs), runs


def block_gemms(size):
    """The block's twelve GEMMs as mamba_ext/cpu/linear.pyx calls BLAS (column-major: C (m, n)
    = op(A) (m, k) . op(B) (k, n)): (name, transa, transb, m, n, k) per linear, forward,
    dinput and dweight."""
    Dm, D, N, K, R, B, L = SIZES[size]
    M, P = B * L, R + 2 * N
    out = []
    for name, IC, OC in (("in_proj", Dm, 2 * D), ("x_proj", D, P), ("dt_proj", R, D),
                         ("out_proj", D, Dm)):
        out += [(f"{name} forward", "T", "N", OC, M, IC), (f"{name} dinput", "N", "N", IC, M, OC),
                (f"{name} dweight", "N", "T", IC, OC, M)]
    return out


def gemm_layouts(size, repeat):
    """Each GEMM of the block timed alone through SciPy's BLAS (the library our kernels
    call through scipy.linalg.cython_blas), in our operand layout and in the three others
    of the same (m, n, k): [(name, layout, GFLOP/s ours, GFLOP/s of the best layout, best
    layout)], best of max(repeat, 10) runs each. ours / best >= 0.85 is issue 12's goal."""
    from scipy.linalg import blas
    rng = np.random.default_rng(2)
    rows = []
    for name, ta, tb, m, n, k in block_gemms(size):
        c = np.asfortranarray(rng.standard_normal((m, n), dtype=np.float32))
        rate = {}
        for la, lb in (("N", "N"), ("N", "T"), ("T", "N"), ("T", "T")):
            # F-ordered operands: f2py passes them to BLAS without a copy
            a = np.asfortranarray(rng.standard_normal((m, k) if la == "N" else (k, m),
                                                      dtype=np.float32))
            b = np.asfortranarray(rng.standard_normal((k, n) if lb == "N" else (n, k),
                                                      dtype=np.float32))
            t = _median_time(lambda a=a, b=b, c=c, ta_=la == "T", tb_=lb == "T":
                             blas.sgemm(1.0, a, b, 1.0, c, trans_a=ta_, trans_b=tb_,
                                        overwrite_c=True), max(repeat, 10), stat=min)
            rate[la + lb] = 2.0 * m * n * k / t
        best = max(rate, key=rate.get)
        rows.append((name, ta + tb, rate[ta + tb], rate[best], best))
    return rows


# Whole training steps of ``bench --model-step``: name -> (V, Dm, n_layers, B, L), the two
# configurations of issue 12 (byte-level LM, d_state 16, expand 2).
MODEL_STEPS = {"2x64": (256, 64, 2, 16, 128), "4x256": (256, 256, 4, 8, 512)}


def step_time(name, repeat=5, n_threads=None, settle_s=None):
    """Median seconds of one training step (model_loss_and_grads + AdamW) of
    ``MODEL_STEPS[name]`` over ``repeat`` steps, timed once the process has done ``settle_s``
    (default SETTLE_S) seconds of benchmark work."""
    from ..model import init_model_params, model_loss_and_grads
    from ..optim import AdamW
    V, Dm, nl, B, L = MODEL_STEPS[name]
    params = init_model_params(V, Dm, nl, seed=0)
    opt = AdamW(params, lr=1e-3, n_threads=n_threads)
    tok = np.random.default_rng(0).integers(0, V, (B, L + 1))
    x, y = tok[:, :-1], tok[:, 1:]
    return _median_time(
        lambda: opt.step(model_loss_and_grads(x, y, params, n_threads=n_threads)[1]), repeat,
        settle_s=SETTLE_S if settle_s is None else settle_s)


def model_step(name, repeat=5, n_threads=None):
    """Median seconds of one training step (model_loss_and_grads + AdamW) of
    ``MODEL_STEPS[name]`` and its bound: the GEMM FLOPs of forward + backward (every
    block's four linears and the tied head) at the GEMM rate of :func:`machine_rates`,
    plus the scan's 2*M*D*N exponentials per layer at the exp rate, both measured in this
    process. step/bound is the median of :data:`BOUND_ROUNDS` rounds' ratios (a step
    timed, then the bound; :func:`interleaved_ratio`).
    Returns (step s, bound s, GEMM FLOP/s, exp/s, what the GEMM rate is, step/bound, the
    rounds [(step s, bound s)]): step s the median over the first timing and the rounds',
    bound s over the rounds'."""
    V, Dm, nl, B, L = MODEL_STEPS[name]
    D, N, R, M = 2 * Dm, 16, math.ceil(Dm / 16), B * L
    flops = nl * 6 * M * (Dm * 2 * D + D * (R + 2 * N) + R * D + D * Dm) + 6 * M * V * Dm
    rates = []

    def bound():
        rates.append(machine_rates(M, Dm, D, repeat, n_threads or _cores()))
        return flops / rates[-1][0] + nl * 2 * M * D * N / rates[-1][1]

    t = step_time(name, repeat, n_threads)            # (settles the process first)
    ratio, runs = interleaved_ratio(lambda: step_time(name, repeat, n_threads, 0.0), bound)
    sgemm_rate, exp_rate, what = rates[0]
    return (statistics.median([t] + [r[0] for r in runs]),
            statistics.median(r[1] for r in runs), sgemm_rate, exp_rate, what, ratio, runs)


def _child_times(what, repeat, n_threads, configured):
    """Median seconds of each (kind, name) of ``what`` (kind "block": a size of SIZES,
    "step": a MODEL_STEPS name) measured in a fresh interpreter: a plain library call
    (import, call), or with :func:`mamba_ext.configure_threads` called first."""
    import json
    import subprocess
    code = ("import json, sys\n"
            + ("import mamba_ext; mamba_ext.configure_threads()\n" if configured else "")
            + "from mamba_ext.bench.cpu import MODEL_STEPS, SIZES, bench_ours, step_time\n"
            # the configurations as this process has them (a caller may have added some)
            + f"MODEL_STEPS.update({ {n: MODEL_STEPS[n] for k, n in what if k == 'step'}!r})\n"
            + f"SIZES.update({ {n: SIZES[n] for k, n in what if k == 'block'}!r})\n"
            + f"what, rep, nt = {list(what)!r}, {int(repeat)}, {n_threads!r}\n"
            # at least ~1 s of timed calls each (up to 60 calls), which settles the process
            # too (no SETTLE_S): the median of a few calls of a few ms moved the
            # plain/configured ratio by 20% between runs
            + "def one(k, n, r):\n"
              "    return bench_ours(n, 'float32', r, nt, 0.0)['t'] if k == 'block' else "
              "step_time(n, r, nt, 0.0)\n"
              "res = [one(k, n, max(rep, min(60, int(1.0 / max(one(k, n, 1), 1e-4))))) "
              "for k, n in what]\n"
            + "print(json.dumps(res))\n")
    # the child imports mamba_ext from where this process does (as multiprocessing's spawn)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


# rounds of plain_vs_configured in the bench: with 2 (and a few calls per process), calls of
# a few ms (size b, the 2 x 64 step) moved the ratio from 0.76 to 1.19 between runs on a
# 2-core machine
PLAIN_ROUNDS = 4


def plain_vs_configured(what, repeat=5, n_threads=None, rounds=PLAIN_ROUNDS):
    """{(kind, name): (plain s, configured s)}: each in its own process, the two kinds of
    process alternated ``rounds`` times; the median over the rounds of each one's median."""
    plain, conf = [], []
    for _ in range(rounds):
        plain.append(_child_times(what, repeat, n_threads, False))
        conf.append(_child_times(what, repeat, n_threads, True))
    return {w: (statistics.median(p[i] for p in plain), statistics.median(c[i] for c in conf))
            for i, w in enumerate(what)}


def print_plain_vs_configured(res, rounds):
    print(f"plain library call (import, call) vs mamba_ext.configure_threads() first, each in "
          f"its own process, alternated, {rounds} rounds (median):")
    for (kind, name), (p, c) in res.items():
        label = f"size {name} fwd+bwd" if kind == "block" else f"model step {name}"
        print(f"  {label:22s} plain {p * 1e3:8.1f} ms   configured {c * 1e3:8.1f} ms   "
              f"plain/configured {p / c:.2f}", flush=True)


def run_model_steps(names, repeat=5, n_threads=None, compare=True) -> int:
    """Print one line per model of ``names`` (keys of MODEL_STEPS), then (``compare``)
    the plain and configured calls of the same steps in their own processes; returns 0."""
    for n in names:
        t, bound, sg, ex, what, ratio, runs = model_step(n, repeat, n_threads)
        V, Dm, nl, B, L = MODEL_STEPS[n]
        print(f"model {nl} x {Dm}, vocab {V}, B {B} x L {L}: training step (forward, backward, "
              f"AdamW) {t * 1e3:.4g} ms = {B * L / t:,.0f} tokens/s; bound {bound * 1e3:.4g} ms "
              f"(GEMMs at {sg / 1e9:.0f} GFLOP/s, exp at {ex / 1e9:.2f} G/s): step/bound "
              f"{ratio:.2f} (steps: medians of {repeat}; the ratio: {_rounds_note(runs)}); "
              f"GEMM rate: {what}", flush=True)
    if compare:
        what = [("step", n) for n in names]
        print_plain_vs_configured(plain_vs_configured(what, repeat, n_threads), PLAIN_ROUNDS)
    return 0


def _rounds_note(runs) -> str:
    return (f"median of {len(runs)} rounds of ours then the bound, "
            + " ".join(f"{t / b:.3f}" for t, b in runs))


def bench_torch(size, repeat, ours):
    import torch

    from ..testing import torch_block as tb
    x, params, dout = make_inputs(size, np.float32)
    tx, tp = tb.make_inputs(x, params)
    tdout = torch.tensor(dout)
    res = {}

    def step():
        res["out"], res["dx"], res["grads"] = tb.forward_backward(tx, tp, tdout)

    # torch's intra-op threads can be far slower than one thread on a busy machine:
    # time its default and 1 thread, and keep the faster (the harder baseline)
    default = torch.get_num_threads()
    best = None
    for n in sorted({default, 1}):
        torch.set_num_threads(n)
        t = _median_time(step, repeat, give_up=3 * best[0] if best else math.inf,
                         settle_s=SETTLE_S)
        if best is None or t < best[0]:
            best = (t, n)
    torch.set_num_threads(default)
    t, threads = best
    # agreement with ours: max|torch - ours| / max|ours| over out, dx and every gradient
    pairs = [(res["out"], ours["out"]), (res["dx"], ours["dx"])]
    pairs += [(res["grads"][n], ours["grads"][n]) for n in ours["grads"]]
    agree = max(float(np.max(np.abs(t_.numpy() - o)) / max(float(np.max(np.abs(o))), 1e-30))
                for t_, o in pairs)
    return t, threads, agree


def run(size: str = "all", *, repeat: int = 5, dtype: str = "float32", n_threads: int | None = None,
        use_torch: bool = True, markdown: bool = False, compare: bool = True) -> int:
    """Run the CPU benchmark for ``size`` ("a", "b", "c" or "all") and print its table, then
    (``compare``, float32) a plain library call against a configured one per size, each in
    its own process (:func:`plain_vs_configured`); returns 0. ``n_threads`` None: OpenMP's
    default (all cores). The table itself is measured in this process as a plain call
    (the command line does not call configure_threads)."""
    if repeat < 1:
        raise ValueError(f"repeat: expected an integer >= 1, got {repeat!r}")
    sizes = ["a", "b", "c"] if size == "all" else [size]
    dtype = np.dtype(dtype)

    def progress(what):
        print(f"[bench] {what} ...", file=sys.stderr, flush=True)

    # 1. ours for every size first, so that peak RSS does not include torch
    ours = {}
    for s in sizes:
        progress(f"mamba_ext size {s}")
        ours[s] = bench_ours(s, dtype, repeat, n_threads)
    # thread scaling: the same step on one thread (a child process with BLAS and OpenMP
    # limited to one thread, since the BLAS pool is not ours to resize), then again here
    cores = n_threads or _cores()
    scaling = {}
    if cores > 1:
        for s in sizes:
            progress(f"mamba_ext size {s}, 1 thread")
            one = _one_thread_time(s, dtype, repeat)
            many = bench_ours(s, dtype, repeat, n_threads)["t"]
            scaling[s] = (one, min(many, ours[s]["t"]))
    # 2. the bound
    progress("sgemm and exp rates")
    bound = {s: measure_bound(s, repeat, n_threads or _cores()) for s in sizes}
    # ours/bound and backward/forward from rounds of ours then the bound (interleaved_ratio)
    ratios = {}
    for s in sizes:
        progress(f"size {s}: ours then the bound, {BOUND_ROUNDS} rounds")
        fb = []

        def ours_once(s=s, fb=fb):
            o = bench_ours(s, dtype, repeat, n_threads, 0.0)
            fb.append((o["t"] - o["t_fwd"]) / o["t_fwd"])
            return o["t"]

        ratio, runs = interleaved_ratio(ours_once,
                                        lambda s=s: measure_bound(s, repeat, n_threads or _cores())[0])
        ratios[s] = (ratio, runs, statistics.median(fb))
    gemms = {s: gemm_layouts(s, repeat) for s in sizes} if dtype == np.float32 else {}
    # 3. torch eager (float32), if installed
    torch_res, torch_note = {}, ""
    if use_torch:
        try:
            import torch
            torch_note = f"torch {torch.__version__} eager float32"
        except ImportError:
            torch_note = "torch not installed"
        else:
            for s in sizes:
                progress(f"torch size {s}")
                torch_res[s] = bench_torch(s, repeat, ours[s])
    else:
        torch_note = "torch skipped (--no-torch)"

    print(f"mamba_ext bench: CPU {dtype.name}, forward+backward of one block, median of {repeat} "
          f"(after warm-up: one call, and {SETTLE_S:g} s of work in this process); {_cores()} cores; "
          f"{torch_note}")
    cols = ["size", "Dm", "D", "N", "K", "R", "B", "L", "fwd+bwd ms", "fwd ms", "tokens/s",
            "peak RSS MiB", "cache MiB", "bound ms", "ours/bound", "torch ms", "torch/ours"]
    rows = []
    for s in sizes:
        o = ours[s]
        Dm, D, N, K, R, B, L = SIZES[s]
        t_torch = torch_res[s][0] if s in torch_res else None
        rows.append([s, Dm, D, N, K, R, B, L, f"{o['t'] * 1e3:.1f}", f"{o['t_fwd'] * 1e3:.1f}",
                     f"{B * L / o['t']:,.0f}", f"{o['rss']:.0f}", f"{o['cache_mib']:.2f}",
                     f"{statistics.median(b for _, b in ratios[s][1]) * 1e3:.1f}",
                     f"{ratios[s][0]:.2f}",
                     "-" if t_torch is None else f"{t_torch * 1e3:.1f}",
                     "-" if t_torch is None else f"{t_torch / o['t']:.1f}x"])
    if markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(v) for v in r) + " |")
    else:
        w = [max(len(c), *(len(str(r[i])) for r in rows)) for i, c in enumerate(cols)]
        print("  ".join(c.rjust(w[i]) for i, c in enumerate(cols)))
        for r in rows:
            print("  ".join(str(v).rjust(w[i]) for i, v in enumerate(r)))
    config = blas_config()
    from ..cpu import linear
    print(blas_note(config, _cpu_flags(), linear.gemm_kernel())
          or f"BLAS: SciPy's {config or 'BLAS (unnamed)'}; the core's float32 GEMM: "
             f"{linear.gemm_kernel()}")
    for s in sizes:
        ratio, runs, bwd_fwd = ratios[s]
        print(f"size {s}: ours/bound {ratio:.2f} ({_rounds_note(runs)}; each ours a median of "
              f"{repeat}); backward/forward {bwd_fwd:.2f} (median over the rounds)")
    for s in sizes:
        _, sg, ex, what = bound[s]
        line = (f"size {s}: bound = {gemm_flops(s) / 1e9:.2f} GFLOP at {sg / 1e9:.0f} GFLOP/s ({what}) "
                f"+ {2 * math.prod(SIZES[s][i] for i in (5, 6, 1, 2)) / 1e6:.1f} M exp at {ex / 1e9:.2f} G/s")
        if s in torch_res:
            line += (f"; torch best with {torch_res[s][1]} thread(s), "
                     f"max|torch - ours|/max|ours| over out, dx, grads {torch_res[s][2]:.1e}")
        print(line)
    for s, rows_ in gemms.items():
        worst = min(rows_, key=lambda r: r[2] / r[3])
        print(f"size {s}: GEMMs alone (SciPy sgemm, best of {max(repeat, 10)}), ours / best "
              f"operand layout of the shape: worst {worst[0]} {worst[2] / worst[3]:.2f}")
        for name, lay, ours_r, best_r, best_lay in rows_:
            print(f"  {name:17s} {lay}: {ours_r / 1e9:6.1f} GFLOP/s; best {best_lay} "
                  f"{best_r / 1e9:6.1f}: {ours_r / best_r:.2f}")
    for s, (one, many) in scaling.items():
        print(f"size {s}: thread scaling: 1 thread {one * 1e3:.1f} ms, {cores} threads "
              f"{many * 1e3:.1f} ms: speed-up {one / many:.2f}x, efficiency {one / many / cores:.0%}")
    print("peak RSS: ru_maxrss of this process after our runs (cumulative over the sizes run so far)")
    if compare and dtype == np.float32:
        progress("plain and configured calls, in their own processes")
        print_plain_vs_configured(plain_vs_configured([("block", s) for s in sizes], repeat,
                                                      n_threads), PLAIN_ROUNDS)
    return 0
