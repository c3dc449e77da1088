"""transformers' Mamba on the CPU: patched with mamba_ext.torch against its own paths.

    python -m mamba_ext.bench.torch_hf [--quick]

Needs torch and transformers (and mambapy for the ``use_mambapy=True`` row; without it
transformers falls back to its loop and the row says so). Prints, in one process:

1. A ``MambaForCausalLM`` training step (forward + backward, random weights, vocab 256,
   4 layers x d_model 128, B 4 x L 256): ``use_in_transformers`` against transformers'
   torch path and against ``use_mambapy=True``; the variants alternate, medians, ratios.
   Peak memory: each variant's step in its own child process (Linux), after a 1 x 8 step,
   the peak RSS (VmHWM, reset before the step) above the RSS before it.
2. Greedy ``generate`` at batch 1 on a 130M-like config (24 x 768, vocab 50280, random
   weights): patched transformers against our own ``mamba_ext.recurrent.generate`` on the
   same weights (float32), tokens/s and the tokens compared.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time

TRAIN = {"vocab_size": 256, "hidden_size": 128, "state_size": 16, "num_hidden_layers": 4}
TRAIN_BATCH = (4, 256)
GEN = {"vocab_size": 50280, "hidden_size": 768, "state_size": 16, "num_hidden_layers": 24}


def _models(cfg_kw: dict):
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    from mamba_ext.torch import use_in_transformers
    torch.manual_seed(0)
    base = MambaForCausalLM(MambaConfig(**cfg_kw))
    mp_cfg = copy.deepcopy(base.config)
    mp_cfg.use_mambapy = True
    mambapy = MambaForCausalLM(mp_cfg)
    mambapy.load_state_dict(base.state_dict())
    ours = use_in_transformers(copy.deepcopy(base))
    return {"mamba_ext": ours, "torch path": base, "use_mambapy": mambapy}


def _step(model, ids) -> float:
    model.train()
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    model(ids, labels=ids).loss.backward()
    return time.perf_counter() - t0


def _ids(vocab, batch, length):
    import torch
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, length), generator=g)


def _rss(field: str) -> int:
    """VmRSS / VmHWM (the peak since the last reset) of this process, bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def _child_peak(variant: str) -> int:
    """Bytes by which one training step of `variant` lifts the process's peak RSS above its
    RSS before the step, in a fresh child process (after a 1 x 8 step has paid the one-time
    costs: libraries, thread stacks; the gradients are allocated in the measured step)."""
    code = ("import os, json\n"
            "from mamba_ext.bench.torch_hf import _models, _ids, _step, _rss, TRAIN, TRAIN_BATCH\n"
            f"m = _models(TRAIN)[{variant!r}]\n"
            "ids = _ids(TRAIN['vocab_size'], *TRAIN_BATCH)\n"
            "_step(m, ids[:1, :8]); m.zero_grad(set_to_none=True)\n"
            "with open('/proc/self/clear_refs', 'w') as f:\n"
            "    f.write('5')\n"            # resets the peak (VmHWM) to the current RSS
            "before = _rss('VmRSS')\n"
            "_step(m, ids)\n"
            "print(json.dumps(_rss('VmHWM') - before))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


def bench_training(repeats: int, torch_repeats: int) -> dict:
    from transformers.utils.import_utils import is_mambapy_available
    models = _models(TRAIN)
    ids = _ids(TRAIN["vocab_size"], *TRAIN_BATCH)
    times = {k: [] for k in models}
    for m in models.values():          # warm-up (first-call allocations, thread start)
        _step(m, ids)
    for i in range(repeats):
        for name, m in models.items():
            if name == "torch path" and i >= torch_repeats:
                continue
            times[name].append(_step(m, ids))
    med = {k: statistics.median(v) for k, v in times.items()}
    B, L = TRAIN_BATCH
    print(f"transformers MambaForCausalLM training step, {TRAIN['num_hidden_layers']} x "
          f"{TRAIN['hidden_size']}, V {TRAIN['vocab_size']}, B {B} x L {L}, float32, "
          f"median of {repeats} (torch path: {torch_repeats}), alternated:")
    if not is_mambapy_available():
        print("  (mambapy is not installed: the use_mambapy row is transformers' loop)")
    peaks = {k: _child_peak(k) for k in models}
    for name in models:
        ratio = med[name] / med["mamba_ext"]
        print(f"  {name:<12} {med[name] * 1e3:10.1f} ms/step  {B * L / med[name]:10.0f} tok/s  "
              f"{ratio:6.1f}x mamba_ext's time   peak +{peaks[name] / 2**20:7.1f} MiB")
    return {"median_s": med, "peak_bytes": peaks}


def bench_generate(n_tokens: int, prompt_len: int = 16) -> dict:
    import numpy as np
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    from mamba_ext.io.hf import params_from_hf
    from mamba_ext.recurrent import generate
    from mamba_ext.torch import use_in_transformers
    torch.manual_seed(0)
    model = use_in_transformers(MambaForCausalLM(MambaConfig(**GEN))).eval()
    params, cfg = params_from_hf({k: v.detach().numpy() for k, v in model.state_dict().items()},
                                 model.config.to_dict())
    prompt = _ids(GEN["vocab_size"], 1, prompt_len)
    ts_hf, ts_ours = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                                 do_sample=False)
        ts_hf.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ours = generate(params, prompt.numpy(), n_tokens, eps=cfg["eps"],
                        discretization=cfg["discretization"], temperature=0.0)
        ts_ours.append(time.perf_counter() - t0)
    hf_tokens = out[0, prompt_len:].numpy()
    same = int(np.sum(hf_tokens == ours[0]))
    hf, us = statistics.median(ts_hf), statistics.median(ts_ours)
    print(f"greedy generate, batch 1, {GEN['num_hidden_layers']} x {GEN['hidden_size']}, "
          f"V {GEN['vocab_size']}, prompt {prompt_len} + {n_tokens} tokens, float32, median of 3:")
    print(f"  transformers + use_in_transformers {n_tokens / hf:8.1f} tok/s")
    print(f"  mamba_ext.recurrent.generate       {n_tokens / us:8.1f} tok/s")
    print(f"  ratio (patched time / ours) {hf / us:.2f}; tokens equal: {same} of {n_tokens}")
    return {"hf_s": hf, "ours_s": us, "same": same}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mamba_ext.bench.torch_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and tokens")
    p.add_argument("--no-generate", action="store_true", help="only the training step")
    a = p.parse_args(argv)
    bench_training(3 if a.quick else 7, 1 if a.quick else 3)
    if not a.no_generate:
        bench_generate(16 if a.quick else 64)
    return 0


if __name__ == "__main__":
    sys.exit(main())
