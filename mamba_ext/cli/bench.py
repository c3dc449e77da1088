"""``python -m mamba_ext bench``: forward+backward time and memory of one block.

CPU (default): ``mamba_ext.bench.cpu`` — median time of mamba1_forward + mamba1_backward,
tokens/s, peak RSS, cache bytes, the GEMM+exp bound and the PyTorch eager baseline.
``--device gpu``: ``mamba_ext.bench.gpu`` — the WGSL kernels, their bandwidth and the
PyTorch CUDA baselines. ``--generation``: ``mamba_ext.bench.generation`` — generation
tokens/s of the compiled recurrent step at batch 1 and larger batches, float32 and float16
weights, against the memory-bandwidth cap; prefill tokens/s; and step() against
re-running the forward for every token.
"""
from __future__ import annotations

import sys

from ._common import parser


def build_parser():
    p = parser("bench", __doc__)
    p.add_argument("--size", choices=["a", "b", "c", "d", "all"], default="all",
                   help="block size (mamba_ext.bench.sizes.SIZES; all = a, b, c)")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed runs per measurement (median); default 5 on the CPU, 10 on the GPU")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="where the block runs")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="dtype of the CPU run (the GPU runs float32)")
    p.add_argument("--threads", type=int, default=None,
                   help="n_threads of the CPU kernels (None: all cores)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline(s)")
    p.add_argument("--no-loop", action="store_true",
                   help="GPU: skip the slow PyTorch Python-time-loop baseline")
    p.add_argument("--profile", action="store_true", help="GPU: also time every dispatch alone")
    p.add_argument("--train-step", default=None, metavar="MODELS",
                   help="GPU: time whole-model training steps instead of the block; "
                        "comma-separated from 24x768, 4x256, 24x768-L8192 "
                        "(mamba_ext.bench.sizes.TRAIN_STEPS)")
    p.add_argument("--discretization", choices=["zoh", "euler"], default="zoh",
                   help="GPU: the block's discretization (euler: b_bar = Delta*B, as mamba_ssm's "
                        "kernel; with --no-torch for the block)")
    p.add_argument("--f16-gemm", action="store_true",
                   help="GPU: time the tensor-core products (f16 subgroup matrices, "
                        "kernels/linear_f16.wgsl; MAMBA_EXT_GPU_BACKEND=dawn) on block d's shapes")
    p.add_argument("--amp", action="store_true", help="GPU: mixed precision (the block, "
                   "--train-step): the linear layers on tensor cores where the device has them")
    p.add_argument("--checkpointing", action="store_true",
                   help="GPU --train-step: with activation checkpointing")
    p.add_argument("--model-step", default=None, metavar="MODELS",
                   help="CPU: time whole training steps against their bound instead of the block; "
                        "comma-separated from 2x64, 4x256 (mamba_ext.bench.cpu.MODEL_STEPS)")
    p.add_argument("--no-compare", action="store_true",
                   help="CPU: skip the plain-call vs configure_threads() comparison (each in "
                        "its own process)")
    p.add_argument("--markdown", action="store_true",
                   help="CPU: print the table as Markdown (the GPU tables always are)")
    p.add_argument("--generation", action="store_true",
                   help="generation speed (compiled recurrent step, prefill, bandwidth cap)")
    p.add_argument("--tokens", type=int, default=256,
                   help="tokens per timed generation for --generation (at most 64 at 130m)")
    p.add_argument("--models", default="tiny,130m",
                   help="--generation models: comma-separated from tiny (2 x 64, vocab 512), "
                        "130m (24 x 768, vocab 50280)")
    return p


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        ap.error("--repeat must be >= 1")
    from .._validate import max_threads
    if args.threads is not None and not 1 <= args.threads <= max_threads():
        print(f"error: --threads must be in [1, {max_threads()}], got {args.threads}", file=sys.stderr)
        return 2
    if args.generation:
        if args.tokens < 1:
            ap.error("--tokens must be >= 1")
        from ..bench.generation import MODELS, bench_generation
        models = [m for m in args.models.split(",") if m]
        if not models or any(m not in MODELS for m in models):
            ap.error(f"--models: expected names from {sorted(MODELS)}, got {args.models!r}")
        bench_generation(n_tokens=args.tokens, models=models, repeats=args.repeat or 3,
                         n_threads=args.threads)
        return 0
    if args.model_step is not None:
        from ..bench import cpu
        names = [m for m in args.model_step.split(",") if m]
        if args.device != "cpu" or not names or any(m not in cpu.MODEL_STEPS for m in names):
            ap.error(f"--model-step: CPU only, names from {sorted(cpu.MODEL_STEPS)}, got "
                     f"{args.model_step!r}")
        return cpu.run_model_steps(names, repeat=args.repeat or 5, n_threads=args.threads,
                                   compare=not args.no_compare)
    for given, flag in ((args.f16_gemm, "--f16-gemm"), (args.train_step is not None,
                        "--train-step"), (args.amp, "--amp")):
        if given and args.device != "gpu":
            ap.error(f"{flag} needs --device gpu")
    if args.checkpointing and args.train_step is None:
        ap.error("--checkpointing applies to --device gpu --train-step")
    if args.discretization != "zoh" and args.device != "gpu":
        ap.error("--discretization applies to --device gpu")
    if args.device == "gpu":
        if args.discretization != "zoh" and args.train_step is None and not args.no_torch:
            ap.error("--discretization euler: the block's PyTorch baselines compute ZOH; "
                     "add --no-torch")
        if args.dtype != "float32":
            ap.error("--device gpu runs float32 only")
        from ..bench import gpu
        if args.f16_gemm:
            return gpu.run_f16_gemm(repeat=args.repeat or 10)
        if args.train_step is not None:
            from ..bench.sizes import TRAIN_STEPS
            names = [m for m in args.train_step.split(",") if m]
            if not names or any(m not in TRAIN_STEPS for m in names):
                ap.error(f"--train-step: expected names from {sorted(TRAIN_STEPS)}, got "
                         f"{args.train_step!r}")
            return gpu.run_train_steps(names, steps=args.repeat or 5,
                                       checkpointing=args.checkpointing,
                                       discretization=args.discretization, amp=args.amp)
        return gpu.run(args.size, repeat=args.repeat or 10, use_torch=not args.no_torch,
                       loops=not args.no_loop, profile=args.profile,
                       discretization=args.discretization, amp=args.amp)
    from ..bench import cpu
    return cpu.run(args.size, repeat=args.repeat or 5, dtype=args.dtype, n_threads=args.threads,
                   use_torch=not args.no_torch, markdown=args.markdown,
                   compare=not args.no_compare)


if __name__ == "__main__":
    sys.exit(main())
