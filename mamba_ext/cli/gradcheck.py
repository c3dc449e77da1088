"""``python -m mamba_ext gradcheck``: float64 finite-difference check of every block gradient.

For each small configuration of ``mamba_ext.testing.gradcheck.CONFIGS``, every element
(or a random sample, for the long sequence) of ``x`` and of the 13 parameters is
perturbed and the 4-point central difference of sum(out * dout) is compared with the
analytic gradient of ``mamba1_backward``. Exit status 1 if any relative error exceeds
the threshold, or if the A_log gradient is not exactly 0 at the clamp bounds.
"""
from __future__ import annotations

import sys

from ..testing.gradcheck import CONFIGS, STEP, THRESHOLD, run
from ._common import parser


def build_parser():
    p = parser("gradcheck", __doc__)
    p.add_argument("--config", action="append", choices=sorted(CONFIGS),
                   help="run only this configuration (repeatable); default: all")
    p.add_argument("--threshold", type=float, default=THRESHOLD, help="max relative error")
    p.add_argument("--step", type=float, default=STEP, help="finite-difference step h")
    p.add_argument("--threads", type=int, default=1,
                   help="n_threads for the kernels (these sizes are tiny, and thread start-up "
                        "would dominate the thousands of forward calls)")
    return p


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    from .._validate import max_threads
    if not 1 <= args.threads <= max_threads():
        print(f"error: --threads must be in [1, {max_threads()}], got {args.threads}", file=sys.stderr)
        return 2
    if not (args.step > 0 and args.threshold >= 0):
        ap.error("--step must be > 0 and --threshold >= 0")
    return run(args.config, threshold=args.threshold, h=args.step, n_threads=args.threads)


if __name__ == "__main__":
    sys.exit(main())
