"""Property-based fuzz of the public API (hypothesis), run by tests/api/test_fuzz.py in a
subprocess so that a crash (segfault, abort) fails the test instead of killing pytest.

The property: for any input, a public call returns normally or raises TypeError or
ValueError (a clear refusal); anything else (another exception, a crash, NaN written into
a model that was fine) is a bug. Budget: ``--examples N`` per target, derandomized (the
same cases every run), no example database.

Usage: python tests/api/fuzz_public_api.py [--examples N] [--target NAME ...]
"""
from __future__ import annotations

import argparse
import io
import math
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mamba_ext
from mamba_ext import AdamW, clip_grad_norm, recurrent
from mamba_ext.amp import DynamicLossScaler
from mamba_ext.io import checkpoint as ck

REFUSALS = (TypeError, ValueError)
COUNTS: dict[str, list[int]] = {}

weird_numbers = st.one_of(
    st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(), st.text(max_size=4), st.just(np.float32(1e-5)), st.just(np.int64(3)),
    st.lists(st.integers(0, 3), max_size=2))
small_sizes = st.integers(0, 4)


def mostly(valid, invalid=weird_numbers):
    """Valid values three times out of four: the fuzz must reach the kernels too."""
    return st.integers(0, 3).flatmap(lambda i: valid if i else invalid)


good_eps = mostly(st.floats(1e-8, 1e-1))
good_threads = mostly(st.one_of(st.none(), st.integers(1, 4)),
                      st.one_of(weird_numbers, st.integers(-3, 3000)))
good_disc = st.sampled_from(["zoh", "euler"] * 6 + ["bilinear", "", None])


def attempt(target: str, call) -> None:
    """Run ``call``; a refusal or a result is fine, anything else propagates."""
    ok, refused = COUNTS.setdefault(target, [0, 0])
    try:
        call()
    except REFUSALS:
        COUNTS[target][1] += 1
        return
    COUNTS[target][0] += 1


def _block_params(Dm, D, N, K, R, dtype):
    return mamba_ext.init_mamba1_params(Dm, d_state=N, d_conv=K, expand=max(1, D // Dm), dt_rank=R,
                                        dtype=dtype)


@st.composite
def block_inputs(draw):
    Dm, N, K, R = (draw(st.integers(1, 4)) for _ in range(4))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    p = _block_params(Dm, 2 * Dm, N, K, R, dtype)
    B, L = draw(small_sizes), draw(small_sizes)
    x = np.random.default_rng(draw(st.integers(0, 9))).standard_normal((B, L, Dm)).astype(dtype)
    mutation = draw(st.sampled_from(["none"] * 8 + ["dtype", "shape", "drop", "extra", "x_dtype",
                                                    "x_rank", "nan"]))
    name = draw(st.sampled_from(sorted(p)))
    if mutation == "dtype":
        p[name] = p[name].astype(np.float16 if draw(st.booleans()) else np.int32)
    elif mutation == "shape":
        p[name] = np.zeros(tuple(s + draw(st.integers(-1, 1)) for s in p[name].shape) or (1,), dtype)
    elif mutation == "drop":
        del p[name]
    elif mutation == "extra":
        p[draw(st.text(max_size=6))] = np.zeros(1, dtype)
    elif mutation == "x_dtype":
        x = x.astype(np.float64 if dtype == np.float32 else np.float32)
    elif mutation == "x_rank":
        x = x.reshape(-1)
    elif mutation == "nan":
        p[name] = np.full_like(p[name], np.nan)
    return x, p


@given(block_inputs(), good_eps, good_threads, good_disc, st.booleans())
def fuzz_block(xp, eps, n_threads, disc, with_state):
    x, p = xp
    kw = dict(eps=eps, n_threads=n_threads, discretization=disc, return_state=with_state)

    def call():
        out, cache, *state = mamba_ext.mamba1_forward(x, p, **kw)
        assert out.shape == np.shape(x)
        mamba_ext.mamba1_backward(np.ones_like(out), p, cache, n_threads=n_threads)
    attempt("mamba1_forward/backward", call)


@st.composite
def model_inputs(draw):
    V, Dm, nl = draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.integers(0, 2))
    p = mamba_ext.init_model_params(V, Dm, nl, d_state=draw(st.integers(1, 3)),
                                    d_conv=draw(st.integers(1, 3)), dtype=np.float32)
    B, L = draw(small_sizes), draw(small_sizes)
    tok = np.array(draw(st.lists(st.integers(-2, V + 1), min_size=B * L, max_size=B * L))).reshape(B, L)
    if draw(st.integers(0, 3)):
        tok = np.clip(tok, 0, V - 1).astype(np.int64) if draw(st.booleans()) else tok.astype(np.int64)
    else:
        tok = tok.astype(draw(st.sampled_from([np.float32, np.int8, np.uint64, bool])))
    key = draw(st.sampled_from(["none"] * 6 + ["layer00.wInProj", "layer\u0661.A_log", "layer9.A_log",
                                "embedding", "final_norm", "layer0.nope"]))
    if key == "embedding":
        p["embedding"] = p["embedding"][:, :0]
    elif key == "final_norm":
        p["final_norm"] = p["final_norm"].astype(np.int64)
    elif key != "none":
        p[key] = np.zeros(2, np.float32)
    return tok, p


@given(model_inputs(), good_eps, good_threads, mostly(st.floats(0.5, 4.0)), st.booleans())
def fuzz_model(tp, eps, n_threads, loss_scale, checkpointing):
    tok, p = tp
    attempt("model_forward", lambda: mamba_ext.model_forward(tok, p, eps=eps, n_threads=n_threads))
    attempt("model_loss_and_grads", lambda: mamba_ext.model_loss_and_grads(
        tok, tok, p, checkpointing, eps=eps, loss_scale=loss_scale, n_threads=n_threads))
    attempt("model_workspace_bytes", lambda: mamba_ext.model.model_workspace_bytes(
        p, tok.shape[0] if loss_scale == 1.0 else loss_scale, n_threads or 0, checkpointing))


@given(model_inputs(), mostly(st.integers(1, 3)), good_eps, mostly(st.floats(0, 2)), st.integers(0, 3))
def fuzz_recurrent(tp, batch, eps, temperature, n):
    tok, p = tp
    if batch == 1 and tok.ndim == 2:
        batch = tok.shape[0]                 # mostly the batch of the tokens

    def call():
        state = recurrent.init_state(p, batch, eps=eps)
        recurrent.step(tok[:, 0] if tok.ndim == 2 and tok.shape[1] else tok, p, state)
    attempt("init_state/step", call)
    attempt("generate", lambda: recurrent.generate(p, tok, n, eps=1e-6, temperature=temperature,
                                                   rng=np.random.default_rng(0)))


@given(st.dictionaries(st.text(max_size=3), st.tuples(
    st.sampled_from([np.float32, np.float64, np.float16, np.int32]), st.integers(0, 4),
    st.booleans(), st.booleans()), max_size=3),
    mostly(st.floats(0, 1)), good_eps, mostly(st.floats(0.1, 10)), good_threads)
def fuzz_adamw(spec, lr, eps, grad_scale, n_threads):
    params, grads = {}, {}
    for name, (dtype, n, readonly, bad_grad) in spec.items():
        params[name] = np.ones(n, dtype)
        grads[name] = np.full(n + 1 if bad_grad and n % 2 else n, np.nan if bad_grad else 0.5, dtype)
        params[name].flags.writeable = not readonly
    before = {k: v.copy() for k, v in params.items()}

    def call():
        opt = AdamW(params, lr=lr, eps=eps, n_threads=n_threads)
        for v in params.values():
            v.flags.writeable = False if v.size == 3 else v.flags.writeable   # later read-only
        try:
            opt.step(grads, grad_scale=grad_scale)
        except REFUSALS:
            for k in params:      # all or nothing
                assert np.array_equal(params[k], before[k], equal_nan=True), k
            raise
    attempt("AdamW", call)
    attempt("clip_grad_norm", lambda: clip_grad_norm(grads, lr, n_threads=n_threads))


@given(mostly(st.floats(1, 2 ** 20)), mostly(st.floats(1.5, 4)), mostly(st.floats(0.1, 0.9)),
       mostly(st.integers(1, 100)))
def fuzz_scaler(init_scale, growth, backoff, interval):
    attempt("DynamicLossScaler", lambda: DynamicLossScaler(init_scale, growth, backoff, interval))


_VALID: bytes = b""
_TMP: Path = Path(".")        # a folder of special files (main)


@given(st.one_of(st.binary(max_size=300), st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255))))
def fuzz_checkpoint_bytes(data):
    if isinstance(data, tuple):              # a valid file with one byte set
        pos, value = data
        raw = bytearray(_VALID)
        raw[pos % len(raw)] = value
        data = bytes(raw)
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        attempt("checkpoint.load", lambda: ck.load(f.name))
        attempt("checkpoint.load(require_checksum=False)", lambda: ck.load(f.name, require_checksum=False))


_STATE_PARAMS = mamba_ext.init_model_params(7, 6, 2, d_state=3, seed=0)      # D 12, N 3, K 4

state_values = st.one_of(
    st.tuples(st.integers(0, 3), st.integers(0, 13), st.integers(0, 4)).map(
        lambda s: np.zeros(s, np.float32)),                                  # wrong shapes
    st.sampled_from(["float64", "float16", "int32", "complex64", "object"]).map(
        lambda d: np.zeros((2, 12, 3), d)),                                  # wrong dtypes
    st.just("read-only"), st.just("bytes"), st.just("strided"), st.just("fortran"),
    st.just("list"), st.just("good"), st.none(), st.integers(), st.text(max_size=3))


def _materialize(value, like):
    """An array (or object) to put where ``like`` (a state array) was."""
    if isinstance(value, str) and value == "read-only":
        a = like.copy()
        a.flags.writeable = False
        return a
    if isinstance(value, str) and value == "bytes":
        return np.frombuffer(bytes(like.nbytes), like.dtype).reshape(like.shape)
    if isinstance(value, str) and value == "strided":
        return np.repeat(like, 2, axis=-1)[..., ::2]
    if isinstance(value, str) and value == "fortran":
        return np.asfortranarray(like)
    if isinstance(value, str) and value == "list":
        return like.tolist()
    if isinstance(value, str) and value == "good":
        return np.random.default_rng(0).standard_normal(like.shape).astype(like.dtype)
    return value


@given(st.sampled_from(["h", "conv"]), st.integers(-3, 3), state_values,
       st.sampled_from(["", "eps", "discretization", "batch", "h-list", "conv-list"]),
       weird_numbers)
def fuzz_recurrent_state(slot, layer, value, setting, setting_value):
    """Assign wrong shapes, dtypes, read-only, foreign and non-array values into every slot
    of a live recurrent state, or its settings, then step: a result or a refusal."""
    p = _STATE_PARAMS
    state = recurrent.init_state(p, 2)
    recurrent.step(np.array([1, 2]), p, state)              # the stepper exists now
    arrays = getattr(state, slot)
    try:
        if setting == "h-list":
            state.h = _materialize(value, arrays[0])
        elif setting == "conv-list":
            state.conv = arrays[:layer] if layer >= 0 else arrays + arrays
        elif setting:
            setattr(state, setting, setting_value)
        else:
            arrays[layer] = _materialize(value, arrays[layer])
    except (TypeError, ValueError, AttributeError, IndexError):
        COUNTS.setdefault("recurrent state edit", [0, 0])[1] += 1
        return
    attempt("recurrent state edit", lambda: recurrent.step(np.array([3, 4]), p, state))


def _special_paths(d: Path):
    """Paths that are not regular files: a FIFO (with no writer), devices, a folder, a
    symlink to a device, a missing file; each must be refused at once."""
    import os
    paths = [d, d / "missing", Path("/dev/zero"), Path("/dev/urandom"), Path("/dev/null")]
    if hasattr(os, "mkfifo"):
        fifo = d / "fifo"
        if not fifo.exists():
            os.mkfifo(fifo)
        paths.append(fifo)
    link = d / "zero.safetensors"
    if not link.exists():
        link.symlink_to("/dev/zero")
    paths.append(link)
    return [str(q) for q in paths if q.exists() or q.name == "missing"]


@given(st.integers(0, 6), st.sampled_from(["checkpoint", "corpus", "training", "hf"]))
def fuzz_special_files(which, reader):
    """Readers of user-named files on FIFOs, devices, folders and symlinks to devices: a
    refusal (OSError for a missing file counts as one) within a second, never a hang."""
    import signal
    from mamba_ext.io import hf
    from mamba_ext.training import data, loop
    paths = _special_paths(_TMP)
    path = paths[which % len(paths)]
    call = {"checkpoint": lambda: ck.load(path), "corpus": lambda: data.load_corpus(path),
            "training": lambda: loop.load_training_checkpoint(path),
            "hf": lambda: hf.load_hf(path)}[reader]

    def hang(signum, frame):
        raise RuntimeError(f"{reader} hung on {path}")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(5)
    try:
        attempt(f"special file: {reader}", lambda: _refuse_oserror(call))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _refuse_oserror(call):
    try:
        call()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        raise ValueError(str(e)) from None       # a missing file: refused by open itself


TARGETS = {"block": fuzz_block, "model": fuzz_model, "recurrent": fuzz_recurrent, "adamw": fuzz_adamw,
           "scaler": fuzz_scaler, "checkpoint": fuzz_checkpoint_bytes,
           "recurrent_state": fuzz_recurrent_state, "special_files": fuzz_special_files}


def _cap_memory():
    """Cap this process's address space (MAMBA_EXT_FUZZ_MEMORY_GIB, default 4): work that
    would allocate more must be refused by a size check (ValueError), and a MemoryError
    is a failure of the target, on every machine alike."""
    import os
    try:
        import resource
    except ImportError:
        return None
    if os.environ.get("ASAN_OPTIONS") or "asan" in os.environ.get("LD_PRELOAD", ""):
        return None     # AddressSanitizer reserves terabytes of address space for its shadow
    gib = float(os.environ.get("MAMBA_EXT_FUZZ_MEMORY_GIB", "4"))
    cap = int(gib * 2 ** 30)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return cap


def main(argv=None) -> int:
    global _VALID
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument("--target", action="append", choices=sorted(TARGETS),
                    help="fuzz only this target (repeatable); default: all")
    args = ap.parse_args(argv)
    global _TMP
    _TMP = Path(tempfile.mkdtemp())
    cap = _cap_memory()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "v.safetensors"
        ck.save(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2)}, {"k": "v"})
        _VALID = path.read_bytes()
    config = settings(max_examples=args.examples, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
    failed = []
    for name in args.target or sorted(TARGETS):
        fuzz = TARGETS[name]
        try:
            with np.errstate(all="ignore"):
                config(fuzz)()
        except Exception:
            buf = io.StringIO()
            traceback.print_exc(file=buf)
            failed.append(f"{fuzz.__name__}:\n{buf.getvalue()}")
    for target, (ok, refused) in sorted(COUNTS.items()):
        print(f"fuzz {target:44s} {ok:5d} returned {refused:5d} refused")
    print(f"fuzz total: {sum(a + b for a, b in COUNTS.values())} calls, {len(failed)} failing target(s)"
          + (f" (address space capped at {cap / 2 ** 30:.1f} GiB)" if cap else ""))
    for f in failed:
        print(f, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    assert math.isfinite(1.0)
    sys.exit(main())
