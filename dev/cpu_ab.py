"""Alternated A/B of two checkouts on the CPU (dev/README.md): block sizes (fwd+bwd) and
model training steps as plain library calls, each checkout timed in its own fresh
processes, the two alternated for several rounds; prints each round's medians and, at the
end, the median over rounds of each and their ratio (B / A: below 1, B is faster).

    python dev/cpu_ab.py A_CHECKOUT B_CHECKOUT [--what c,2x64] [--rounds 6] [--seconds 2]

Each checkout must be built in place (python setup.py build_ext --inplace)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
import numpy as np
from mamba_ext.bench.cpu import MODEL_STEPS, SIZES, bench_ours, step_time
what, secs = sys.argv[1].split(","), float(sys.argv[2])
out = {}
for w in what:
    one = (lambda r: bench_ours(w, "float32", r, None)["t"]) if w in SIZES else \\
          (lambda r: step_time(w, r, None))
    t1 = one(1)
    out[w] = one(max(3, min(200, int(secs / max(t1, 1e-4)))))
print(json.dumps(out))
"""


def timed(checkout: str, what: str, seconds: float) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    res = subprocess.run([sys.executable, "-c", CHILD, what, str(seconds)], cwd=checkout,
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--what", default="c,2x64")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    runs = {"A": [], "B": []}
    for r in range(args.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")      # who goes first alternates too
        for k in order:
            runs[k].append(timed(args.a if k == "A" else args.b, args.what, args.seconds))
        print(f"round {r + 1}: " + "  ".join(
            f"{w} A {runs['A'][-1][w] * 1e3:.2f} B {runs['B'][-1][w] * 1e3:.2f} ms"
            for w in args.what.split(",")), flush=True)
    for w in args.what.split(","):
        a = statistics.median(x[w] for x in runs["A"])
        b = statistics.median(x[w] for x in runs["B"])
        wins = sum(xb[w] < xa[w] for xa, xb in zip(runs["A"], runs["B"]))
        print(f"{w}: A {a * 1e3:.2f} ms, B {b * 1e3:.2f} ms, B/A {b / a:.3f} "
              f"(B faster in {wins} of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
