"""Data-parallel training over MPI (mamba_ext.distributed): the sharded data
order and the buckets in one process, and real 2-rank jobs under
``mpiexec -n 2`` (oversubscribed on a 2-core machine): P=2 equals P=1 with the
doubled batch, resume continues exactly, a killed or hung rank ends the job.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import optional

from mamba_ext.distributed import GradReducer, ShardedBatches, launcher_world_size
from mamba_ext.io.checkpoint import load_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mpi_worker.py")
TEXT = (b"The quick brown fox jumps over the lazy dog. " * 3
        + b"def add(a, b):\n    return a + b\n\n" * 3
        + b"Pack my box with five dozen liquor jugs!\n") * 40
JOB_LIMIT = 120     # s: a job still running then has hung (the faults must end far sooner)


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_bytes(TEXT)
    return str(p)


# ------------------------------------------------------------ one process

def test_sharded_ranks_are_disjoint_and_make_up_the_single_process_batch():
    data = np.frombuffer(TEXT, np.uint8)
    b, L = 3, 16
    one = ShardedBatches(data, L, 2 * b, seed=5)
    ranks = [ShardedBatches(data, L, b, seed=5, rank=r, size=2) for r in range(2)]
    for step in (0, 1, 7, 400):       # step 400 lies in a later epoch
        tok = np.concatenate([r.get(step)[0] for r in ranks])
        tgt = np.concatenate([r.get(step)[1] for r in ranks])
        np.testing.assert_array_equal(tok, one.get(step)[0])
        np.testing.assert_array_equal(tgt, one.get(step)[1])
        np.testing.assert_array_equal(tok[:, 1:], tgt[:, :-1])          # targets = next byte
    # one epoch visits every window exactly once; the ranks' windows never overlap
    W = one.n_windows
    assert sorted(one.window_starts(np.arange(W)).tolist()) == list(range(0, W * L, L))
    per_rank = [np.concatenate([r.window_starts(r.samples(k)) for k in range(W // (2 * b))])
                for r in ranks]
    assert len(set(per_rank[0].tolist()) | set(per_rank[1].tolist())) == 2 * b * (W // (2 * b))


def test_resume_with_another_world_size_continues_the_stream():
    data = np.frombuffer(TEXT, np.uint8)
    b, L = 2, 16
    p2 = [ShardedBatches(data, L, b, seed=1, rank=r, size=2) for r in range(2)]
    # 5 steps at P=2 consumed 20 samples; continue at P=4 from there
    pos = p2[0].position(5)
    assert pos == 20 and p2[1].rank_positions(5) == [20, 22]
    p4 = [ShardedBatches(data, L, b, seed=1, rank=r, size=4, start_step=5, start_position=pos)
          for r in range(4)]
    got = np.concatenate([r.samples(6) for r in p4])
    np.testing.assert_array_equal(got, np.arange(28, 36))   # step 6 = samples 28..35
    flat = ShardedBatches(data, L, 1, seed=1)                  # sample s = step s at batch 1
    np.testing.assert_array_equal(p4[3].get(6)[0], np.concatenate([flat.get(34)[0], flat.get(35)[0]]))
    it = iter(p4[1])                                           # the iterator starts at step 5
    np.testing.assert_array_equal(next(it)[0], p4[1].get(5)[0])
    np.testing.assert_array_equal(next(it)[1], p4[1].get(6)[1])


def test_sharded_batches_reject_bad_arguments():
    data = np.frombuffer(TEXT, np.uint8)
    with pytest.raises(ValueError, match="rank"):
        ShardedBatches(data, 16, 2, rank=2, size=2)
    with pytest.raises(ValueError, match="size"):
        ShardedBatches(data, 16, 2, size=0)
    with pytest.raises(ValueError, match="seq_len"):
        ShardedBatches(data[:10], 16, 2)


def test_buckets_are_contiguous_reverse_order_and_closed_at_the_size():
    MPI = optional("mpi4py.MPI", 'pip install "mamba_ext[mpi]"')
    shapes = {"embedding": (256, 8), "layer0.w": (100,), "layer1.w": (300,), "final_norm": (8,)}
    red = GradReducer(MPI.COMM_SELF, shapes, bucket_bytes=1600)    # 400 float32 per bucket
    assert red.groups == [["final_norm", "layer1.w"], ["layer0.w"], ["embedding"]]
    assert [b.size for b in red.buckets] == [308, 100, 2048]
    for k, shape in shapes.items():
        v = red.views[k]
        assert v.shape == shape and np.shares_memory(v, red.buckets[red.bucket_of[k]])
    grads = {k: np.full(s, 3.0, np.float32) for k, s in shapes.items()}
    views, loss, overflow = red.reduce(grads, 2.5, True)     # one rank: the identity
    assert loss == 2.5 and overflow and all((views[k] == 3.0).all() for k in shapes)
    with pytest.raises(ValueError, match="missing"):
        red.reduce({"embedding": grads["embedding"]})
    with pytest.raises(TypeError, match="float32"):
        red.reduce({**grads, "final_norm": np.zeros(8, np.float64)})


class _SlowComm:
    """The test hook of the overlap: one rank whose all-reduces move ``rate`` bytes/s, one
    after another (a slow network). Each returns a receive on MPI.COMM_SELF that a timer
    thread satisfies when its all-reduce would be done: a real MPI request, which the
    reducer tests and waits for as any other."""

    def __init__(self, MPI, rate):
        self.MPI, self.rate, self.free_at, self.tag = MPI, rate, 0.0, 0
        self.keep = []

    def Get_size(self):
        return 1

    def Iallreduce(self, sendbuf, recvbuf, op):
        now = time.monotonic()
        self.free_at = max(now, self.free_at) + np.asarray(recvbuf).nbytes / self.rate
        self.tag += 1
        box = np.zeros(1)
        self.keep.append(box)
        req = self.MPI.COMM_SELF.Irecv(box, source=0, tag=self.tag)
        done = lambda tag=self.tag: self.MPI.COMM_SELF.Send(np.ones(1), dest=0, tag=tag)
        timer = threading.Timer(self.free_at - now, done)
        timer.daemon = True
        timer.start()
        return req


def test_the_all_reduce_runs_during_the_backward():
    """With a deliberately slow all-reduce (one bucket per layer, each taking about half a
    layer's backward), the overlapped step (model_loss_and_grads(grads_ready=
    GradReducer.add), then finish) grows by less than the all-reduce time, and what it
    still waits for at the end is less than half of it, while the reduction after the
    backward waits for all of it; both give the same gradients. The model runs on one
    thread: the other core plays the network. Medians of interleaved runs."""
    MPI = optional("mpi4py.MPI", 'pip install "mamba_ext[mpi]"')
    import mamba_ext
    n_layers = 6
    params = mamba_ext.init_model_params(256, 64, n_layers, seed=0)
    tok = np.random.default_rng(0).integers(0, 256, (8, 256))
    layer_bytes = sum(v.nbytes for k, v in params.items() if k.startswith("layer0."))
    step = lambda **kw: mamba_ext.model_loss_and_grads(tok, tok, params, n_threads=1, **kw)
    step()
    t0 = time.perf_counter()
    step()
    comm = _SlowComm(MPI, rate=layer_bytes / (0.5 * (time.perf_counter() - t0) / n_layers))
    red = GradReducer(comm, params, bucket_bytes=layer_bytes)
    assert len(red.buckets) == n_layers + 1       # one per layer, the head's last
    total = sum(b.nbytes for b in red.buckets) / comm.rate
    times = {"plain": [], "over": [], "over_wait": [], "after": [], "after_wait": []}
    for _ in range(7):
        t0 = time.perf_counter()
        step()
        times["plain"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        loss, grads = step(grads_ready=red.begin().add)
        t1 = time.perf_counter()
        g_over = {k: v.copy() for k, v in red.finish(loss)[0].items()}
        times["over"].append(time.perf_counter() - t0)
        times["over_wait"].append(time.perf_counter() - t1)
        t0 = time.perf_counter()
        loss, grads = step()
        t1 = time.perf_counter()
        g_after = red.reduce(grads, loss)[0]
        times["after"].append(time.perf_counter() - t0)
        times["after_wait"].append(time.perf_counter() - t1)
        assert all(np.array_equal(g_over[k], g_after[k]) for k in params)
    t = {k: float(np.median(v)) for k, v in times.items()}
    assert t["after_wait"] > 0.9 * total, (t, total)
    assert t["over_wait"] < 0.5 * total, (t, total)
    assert t["over"] - t["plain"] < total, (t, total)


def test_grad_reducer_parts_are_checked():
    MPI = optional("mpi4py.MPI", 'pip install "mamba_ext[mpi]"')
    shapes = {"a": (4,), "b": (3,)}
    red = GradReducer(MPI.COMM_SELF, shapes)
    g = {k: np.ones(s, np.float32) for k, s in shapes.items()}
    with pytest.raises(RuntimeError, match="begin"):
        red.add(["a"], g)
    red.begin().add(["a"], g)
    with pytest.raises(ValueError, match="added twice"):
        red.add(["a"], g)
    with pytest.raises(ValueError, match="not a gradient"):
        red.add(["c"], g)
    with pytest.raises(ValueError, match="never added"):
        red.finish()
    red.begin().add(["b", "a"], g)
    views, loss, overflow = red.finish(1.5)
    assert loss == 1.5 and not overflow and (views["a"] == 1).all()


@pytest.mark.parametrize("env,expect", [({}, 1), ({"OMPI_COMM_WORLD_SIZE": "4"}, 4),
                                        ({"PMI_SIZE": "3"}, 3), ({"SLURM_STEP_NUM_TASKS": "8"}, 8),
                                        ({"PMI_SIZE": "3", "MAMBA_EXT_DISTRIBUTED": "0"}, 1)])
def test_launcher_world_size_reads_the_launchers_variables(monkeypatch, env, expect):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS",
                "MAMBA_EXT_DISTRIBUTED"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launcher_world_size() == expect


# ------------------------------------------------------------ mpiexec -n 2

def _mpiexec(n=2):
    """The launcher of the MPI that mpi4py loads, with its oversubscribe option."""
    optional("mpi4py.MPI", 'pip install "mamba_ext[mpi]" (mpi4py + the mpich wheel)')
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = here if os.path.exists(here) else shutil.which("mpiexec")
    if exe is None:
        optional("mamba_ext_no_mpiexec", 'no mpiexec found: pip install "mamba_ext[mpi]"')
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    cmd = [exe, "-n", str(n)]
    if re.search(r"Open MPI|OpenRTE|open-mpi", version.stdout + version.stderr):
        cmd.append("--oversubscribe")                     # Hydra (MPICH) oversubscribes by itself
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd


def _job(args, tmp_path, extra_env=None, n=2):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra_env or {})
    t0 = time.monotonic()
    try:
        p = subprocess.run(_mpiexec(n) + args, capture_output=True, text=True, env=env,
                           timeout=JOB_LIMIT, cwd=tmp_path, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpiexec job still running after {JOB_LIMIT} s (a hang): {e.stderr}")
    return p, time.monotonic() - t0


def test_two_ranks_match_one_rank_with_the_doubled_batch_and_resume_exactly(corpus, tmp_path):
    out = tmp_path / "api"
    out.mkdir()
    p, _ = _job([sys.executable, WORKER, "api", corpus, str(out)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads((out / "result.json").read_text())
    assert res["size"] == 2
    # the Python API loop of docs/distributed.md: both ranks end with the same weights
    assert res["example_same_weights"] is True and res["example_moved"] is True
    # allreduce_grads: the mean of the two ranks (float32 sum, exact /2), the same bits on both
    assert res["allreduce_max_err"] < 1e-6 and res["allreduce_identical"]
    assert res["overflow_any"] == [True, True] and res["loss_mean"] == 0.5
    assert res["stream_max_err"] < 1e-6 and res["stream_scalars"] == [0.5, False]
    # fp16 on the wire (mixed precision, P = 2): the float32 path's bits, the exact mean
    # to float32 rounding, and the default at P = 2 (large parts only)
    assert res["fp16_wire_bitwise"] and res["fp16_wire_auto"] == [True, False], res
    assert res["fp16_wire_max_rel_err"] < 2 ** -23, res
    assert res["overlap_bitwise"] is True and res["overlap_buckets"] > 2
    # P=2 x b=4 vs P=1 x b=8 on the same 6 x 8 samples: equal up to float32 summation order
    # (two means of 128 positions averaged vs one mean of 256 in the compiled backward,
    # ~1e-7 relative per gradient, amplified a little by Adam's normalisation); measured
    # 8e-7 on weights of magnitude up to ~2 after 6 steps at lr 1e-2, so 2e-5 (= lr/500).
    assert res["p2_vs_p1_max_abs"] < 2e-5
    assert res["p2_vs_p1_max_rel_loss"] < 1e-6
    assert res["weights_moved"] > 0.5
    # P=2: stop after 4 of 8 steps, resume: bit-identical losses and weights (also with AMP)
    assert res["resume_exact_ampFalse"] is True and res["resume_exact_ampTrue"] is True
    assert "ranks disagree on the weights after step 7" in res["divergence"]


def test_gpu_ranks_match_one_gpu_with_the_doubled_batch(corpus, tmp_path):
    gpu = optional("mamba_ext.gpu", "pip install wgpu; needs a Vulkan/Metal/D3D12 adapter")
    if not gpu.available():
        optional("mamba_ext_no_gpu_adapter", "no GPU adapter (apt-get install mesa-vulkan-drivers)")
    out = tmp_path / "gpu"
    out.mkdir()
    p, _ = _job([sys.executable, WORKER, "gpu", corpus, str(out)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads((out / "result.json").read_text())
    # the arena is read back, all-reduced, written back; grad norm + AdamW on the GPU
    # (same tolerance and reason as the CPU test above)
    assert res["p2_vs_p1_max_abs"] < 2e-5, res
    np.testing.assert_allclose(res["losses"][0], res["losses"][1], rtol=1e-6)
    # AMP (--device gpu --amp --distributed): each rank rounds its own scaled gradient to
    # fp16 (2^-11 relative) before the mean, one process its whole batch's, so the weights
    # agree to AMP's precision, not float32's: on average the two runs' weights differ by
    # 1.2e-4 of how far they moved (measured; asked: < 4 x 2^-11); an element whose
    # gradient is near zero may move by up to lr per step either way under Adam, so the
    # largest difference is bounded by lr x steps / 10 = 4e-3 (measured 1.4e-3)
    assert res["amp_skipped"][0] == res["amp_skipped"][1], res
    assert res["amp_mean_diff_over_mean_move"] < 4 * 2.0 ** -11, res
    assert res["amp_p2_vs_p1_max_abs"] < 4e-3, res
    np.testing.assert_allclose(res["amp_losses"][0], res["amp_losses"][1], rtol=1e-4)


def test_cli_auto_detects_mpiexec_and_resumes_with_another_world_size(corpus, tmp_path):
    common = ["--data", corpus, "--d-model", "16", "--n-layers", "1", "--d-state", "4",
              "--seq-len", "16", "--batch", "3", "--quiet"]
    p, _ = _job([sys.executable, "-m", "mamba_ext", "train", *common, "--steps", "4",
                 "--checkpoint-every", "2", "--out", "run"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 processes started by an MPI launcher" in p.stderr
    assert "2 ranks, global batch 6" in p.stderr
    assert p.stderr.count("done: 4 steps") == 1                   # rank 0 alone speaks
    state = load_checkpoint(tmp_path / "run" / "checkpoint.safetensors")
    d = state["extra"]["distributed"]
    assert state["step"] == 4 and d["world_size"] == 2 and d["data_position"] == 24
    assert d["rank_positions"] == [24, 27]
    # resume with P = 1 (a plain process): the stream goes on at sample 24
    q = subprocess.run([sys.executable, "-m", "mamba_ext", "train", "--distributed", "--resume",
                        "run", "--steps", "6", "--quiet"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=JOB_LIMIT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert q.returncode == 0, q.stderr
    d = load_checkpoint(tmp_path / "run" / "checkpoint.safetensors")["extra"]["distributed"]
    assert d["world_size"] == 1 and d["data_position"] == 24 + 2 * 3


def test_one_process_and_one_rank_read_the_same_stream(corpus, tmp_path):
    """``train`` and ``mpiexec -n 1 train --distributed`` read the same windows in the same
    order (one data stream, training.data.ShardedBatches) and end with the same weights,
    bit for bit; both checkpoints hold the stream position."""
    common = ["--data", corpus, "--d-model", "16", "--n-layers", "1", "--d-state", "4",
              "--seq-len", "16", "--batch", "3", "--steps", "5", "--threads", "1", "--quiet"]
    plain = subprocess.run([sys.executable, "-m", "mamba_ext", "train", *common, "--out", "plain"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=JOB_LIMIT,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert plain.returncode == 0, plain.stderr
    p, _ = _job([sys.executable, "-m", "mamba_ext", "train", "--distributed", *common,
                 "--out", "rank"], tmp_path, n=1)
    assert p.returncode == 0, p.stdout + p.stderr
    a, b = (load_checkpoint(tmp_path / d / "checkpoint.safetensors") for d in ("plain", "rank"))
    assert a["params"].keys() == b["params"].keys()
    assert all(np.array_equal(a["params"][k], b["params"][k]) for k in a["params"])
    for st in (a, b):
        d = st["extra"]["distributed"]
        assert d["world_size"] == 1 and d["data_position"] == 5 * 3


@pytest.mark.parametrize("mode,blocking", [("kill", "1"), ("hang", "1"), ("hang", "0")])
def test_a_dead_or_hung_rank_ends_the_job_with_an_error(corpus, tmp_path, mode, blocking):
    """blocking=1: Waitall under a watchdog thread; 0: Testall polling with a deadline."""
    out = tmp_path / mode
    timeout = 3
    p, wall = _job([sys.executable, WORKER, mode, corpus, str(out)], tmp_path,
                   {"MX_TEST_TIMEOUT": str(timeout), "MX_TEST_BLOCKING": blocking})
    text = p.stdout + p.stderr
    assert p.returncode != 0, text
    assert "UNREACHABLE" not in text
    if mode == "kill":      # the launcher notices the death and ends the others
        assert re.search(r"signal 9|KILLED|Killed|exited on signal", text), text
    else:                   # rank 0's deadline: our message, then MPI_Abort
        assert f"rank 0/2: no answer within {timeout} s in the all-reduce of gradients at step 3" \
            in text, text
        assert wall < timeout + 30
    # the last checkpoint (after step 2) is complete and loads
    state = load_checkpoint(out / "checkpoint.safetensors")
    assert state["step"] == 2 and state["extra"]["distributed"]["rank_positions"] == [16, 20]


def test_gpu_index_counts_real_adapters_before_software_ones():
    from types import SimpleNamespace
    from mamba_ext.gpu import device

    def fake(*adapters):
        ads = [SimpleNamespace(info={"device": d, "backend_type": b, "adapter_type": t})
               for d, b, t in adapters]
        return SimpleNamespace(gpu=SimpleNamespace(enumerate_adapters_sync=lambda: ads))

    w = fake(("H200 a", "Vulkan", "DiscreteGPU"), ("llvmpipe", "Vulkan", "CPU"),
             ("H200 b", "Vulkan", "DiscreteGPU"), ("H200 a", "OpenGL", "DiscreteGPU"))
    assert [a.info["device"] for a in device._adapters(w)] == ["H200 a", "H200 b"]
    assert device._adapter_by_index(w, "1").info["device"] == "H200 b"
    with pytest.raises(RuntimeError, match=r"MAMBA_EXT_GPU_INDEX='2'.*\[0, 2\)"):
        device._adapter_by_index(w, "2")
    w = fake(("llvmpipe", "Vulkan", "CPU"), ("llvmpipe", "OpenGL", "CPU"))
    assert [a.info["backend_type"] for a in device._adapters(w)] == ["Vulkan"]


@pytest.mark.parametrize("args,message", [
    (["--distributed", "--dist-timeout", "0"], "--dist-timeout: expected a number of seconds > 0"),
    (["--distributed", "--check-every", "-1"], "--check-every: expected an integer >= 0"),
    (["--gpu-index", "-1"], "--gpu-index: expected an adapter index >= 0"),
])
def test_cli_rejects_bad_distributed_options(capsys, args, message):
    from mamba_ext.cli.train import main
    assert main(args + ["--steps", "1", "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_gpu_index_chosen_without_touching_the_environment(monkeypatch):
    """--gpu-index (and each rank's adapter) reaches the device through
    gpu.device.use_adapter, not through os.environ; a later choice of another adapter
    once the device is open is refused, as is a bad index."""
    import os
    from types import SimpleNamespace
    from mamba_ext.cli.train import build_parser
    from mamba_ext.gpu import device
    from mamba_ext.cli import distributed
    monkeypatch.setattr(device, "_ADAPTER_INDEX", None)
    monkeypatch.setattr(device, "_GPU", None)
    before = dict(os.environ)
    args = build_parser().parse_args(["--device", "gpu", "--gpu-index", "3"])
    assert distributed.from_args(args, print) is None
    assert dict(os.environ) == before
    assert device._ADAPTER_INDEX == 3
    monkeypatch.setattr(device, "_GPU", SimpleNamespace(adapter_index=3))
    device.use_adapter(3)                               # the same adapter: fine
    with pytest.raises(RuntimeError, match="already open on adapter 3"):
        device.use_adapter(1)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="index: expected an adapter index"):
            device.use_adapter(bad)
