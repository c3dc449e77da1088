"""Hugging Face Mamba interop: converter round trips, refusals, and parity with
``transformers.MambaForCausalLM`` on the CPU (logits, every gradient, greedy generation
from a ``save_pretrained`` folder, and our exports loaded by ``from_pretrained``).

The parity tests need torch + transformers (pip install torch transformers); without
them they skip with a message, except under CI (CI set), where they must run.
Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank, V vocab.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from conftest import optional

from mamba_ext.io.hf import load_hf, params_from_hf, params_to_hf, save_hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # everything here is local; never wait on a network

# |ours - theirs| <= ATOL * max|theirs| + RTOL * |theirs|: both sides float32, so the golden
# README's float32 rule applies (measured: at most ~2.9e-6 * max|theirs|, about 15% of it).
ATOL, RTOL = 2e-5, 1e-4


def _assert_close(name, ours, theirs, atol=ATOL, rtol=RTOL):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape, f"{name}: shape {ours.shape} vs {theirs.shape}"
    scale = float(np.abs(theirs).max()) if theirs.size else 0.0
    err = np.abs(ours - theirs)
    tol = atol * scale + rtol * np.abs(theirs)
    assert np.all(err <= tol), (f"{name}: max |diff| {err.max():.3g} (max|ref| {scale:.3g}); "
                                f"{int((err > tol).sum())} of {err.size} out of tolerance")
    return float((err / np.where(tol > 0, tol, 1)).max())


def _require_transformers():
    """Skip without torch/transformers locally; FAIL under CI=true (conftest.optional)."""
    why = "pip install torch transformers to run the Hugging Face parity tests"
    optional("torch", why)
    optional("transformers", why)


# ---- random models in our layout (no torch needed) -------------------------------------

def _our_random_params(seed, V=19, Dm=6, D=12, N=3, K=4, R=2, n_layers=2, hf_compatible=True):
    """Random params; ``hf_compatible`` zeroes bXProj / lm_head_bias (no HF counterpart)."""
    from mamba_ext._validate import BlockDims, block_param_shapes
    rng = np.random.default_rng(seed)
    p = {"embedding": rng.normal(0, 0.5, (V, Dm)), "final_norm": rng.normal(1, 0.2, Dm),
         "lm_head_bias": np.zeros(V) if hf_compatible else rng.normal(0, 0.3, V)}
    for i in range(n_layers):
        for name, shape in block_param_shapes(BlockDims(Dm=Dm, D=D, N=N, K=K, R=R)).items():
            if name == "A_log":
                v = rng.uniform(-2, 2, shape)
            elif name == "bXProj" and hf_compatible:
                v = np.zeros(shape)
            elif name.startswith("b"):
                v = rng.normal(0, 0.3, shape)
            elif name in ("D_vec", "normWeight"):
                v = rng.normal(1, 0.3, shape)
            else:
                v = rng.normal(0, 1 / math.sqrt(shape[-1]), shape)
            p[f"layer{i}.{name}"] = v
    return {k: v.astype(np.float32) for k, v in p.items()}


CONFIG = {"eps": 1e-5, "discretization": "euler"}


def test_round_trip_ours_hf_ours_is_exact():
    p = _our_random_params(0)
    tensors, hf_cfg = params_to_hf(p, CONFIG)
    assert hf_cfg["use_bias"] is True and hf_cfg["layer_norm_epsilon"] == 1e-5
    assert hf_cfg["expand"] == 2 and hf_cfg["time_step_rank"] == 2 and hf_cfg["conv_kernel"] == 4
    # the conv taps are stored reversed: HF's last tap multiplies the current step
    np.testing.assert_array_equal(tensors["backbone.layers.1.mixer.conv1d.weight"][:, 0, -1],
                                  p["layer1.wConv"][:, 0])
    back, cfg = params_from_hf(tensors, hf_cfg)
    assert cfg["eps"] == 1e-5 and cfg["discretization"] == "euler"
    assert (cfg["d_model"], cfg["d_inner"], cfg["d_state"], cfg["d_conv"], cfg["dt_rank"],
            cfg["n_layers"], cfg["vocab_size"]) == (6, 12, 3, 4, 2, 2, 19)
    assert sorted(back) == sorted(p)
    for k in p:
        np.testing.assert_array_equal(back[k], p[k], err_msg=k)


def test_round_trip_hf_ours_hf_and_missing_biases_become_zeros():
    p = _our_random_params(1, Dm=4, D=8, K=2, R=1, n_layers=1)
    for k in ("layer0.bInProj", "layer0.bOutProj"):
        p[k][:] = 0
    tensors, hf_cfg = params_to_hf(p, CONFIG)
    assert hf_cfg["use_bias"] is False                     # all in/out biases zero -> not written
    assert "backbone.layers.0.mixer.in_proj.bias" not in tensors
    # a checkpoint without conv bias (use_conv_bias false) and with the old embedding name
    del tensors["backbone.layers.0.mixer.conv1d.bias"]
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    tensors["lm_head.weight"] = tensors["backbone.embedding.weight"].copy()   # tied copy is fine
    hf_cfg = dict(hf_cfg, use_conv_bias=False, time_step_rank="auto")      # auto: ceil(4/16) = 1
    back, cfg = params_from_hf(tensors, hf_cfg)
    assert cfg["dt_rank"] == 1
    for k in ("layer0.bInProj", "layer0.bOutProj", "layer0.bConv", "layer0.bXProj", "lm_head_bias"):
        assert back[k].dtype == np.float32 and not back[k].any(), k
    again, _ = params_to_hf(back, cfg)
    for k, v in again.items():
        ref = tensors.get(k, tensors["backbone.embedding.weight"] if "embeddings" in k else None)
        if k.endswith("conv1d.bias"):
            ref = np.zeros_like(v)
        np.testing.assert_array_equal(v, ref, err_msg=k)


def test_save_and_load_folder(tmp_path):
    p = _our_random_params(2)
    hf_cfg = save_hf(tmp_path / "m", p, CONFIG)
    assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == hf_cfg
    back, cfg = load_hf(tmp_path / "m")
    assert cfg["eps"] == 1e-5
    for k in p:
        np.testing.assert_array_equal(back[k], p[k], err_msg=k)
    back64, _ = load_hf(tmp_path / "m", dtype=np.float64)
    assert back64["embedding"].dtype == np.float64


@pytest.mark.parametrize("change, match", [
    (lambda p, c: p["layer1.bXProj"].__setitem__(0, 0.5), "bXProj: non-zero"),
    (lambda p, c: p["lm_head_bias"].__setitem__(3, 0.1), "lm_head_bias: non-zero"),
    (lambda p, c: c.__setitem__("discretization", "zoh"), "Euler"),
    (lambda p, c: c.pop("eps"), "missing 'eps'"),
])
def test_export_refuses_what_hf_cannot_represent(change, match):
    p, c = _our_random_params(3), dict(CONFIG)
    change(p, c)
    with pytest.raises(ValueError, match=match):
        params_to_hf(p, c)


def test_export_zoh_only_when_asked_and_a_log_clipped():
    p = _our_random_params(4, n_layers=1)
    p["layer0.A_log"][0, :2] = [7.0, -12.0]               # our forward clamps these anyway
    tensors, _ = params_to_hf(p, {"eps": 1e-6, "discretization": "zoh"},
                              approximate_discretization=True)
    assert tensors["backbone.layers.0.mixer.A_log"][0, :2].tolist() == [5.0, -10.0]


def test_export_refuses_d_inner_not_multiple_of_d_model():
    p = _our_random_params(5, Dm=4, D=10, n_layers=1)
    with pytest.raises(ValueError, match="not a multiple of dModel"):
        params_to_hf(p, CONFIG)


def _hf_pair():
    return params_to_hf(_our_random_params(6, n_layers=1), CONFIG)


@pytest.mark.parametrize("change, match", [
    (lambda t, c: c.__setitem__("hidden_act", "gelu"), "hidden_act 'gelu'"),
    (lambda t, c: c.__setitem__("tie_word_embeddings", False), "tie_word_embeddings"),
    (lambda t, c: c.__setitem__("model_type", "mamba2"), "model_type 'mamba2'"),
    (lambda t, c: c.pop("hidden_size"), "missing required field 'hidden_size'"),
    (lambda t, c: t.__setitem__("lm_head.weight", t["backbone.embeddings.weight"] + 1),
     "lm_head.weight differs"),
    (lambda t, c: t.__setitem__("lm_head.bias", np.zeros(19, np.float32)), "lm_head.bias"),
    (lambda t, c: t.__setitem__("backbone.layers.0.mixer.x_proj.bias", np.zeros(8, np.float32)),
     "unexpected tensor"),
    (lambda t, c: t.pop("backbone.layers.0.mixer.dt_proj.bias"),
     "missing tensor 'backbone.layers.0.mixer.dt_proj.bias'"),
    (lambda t, c: t.__setitem__("backbone.layers.0.mixer.A_log", np.full((12, 3), 6.0, np.float32)),
     r"outside \[-10, 5\]"),
    (lambda t, c: t["backbone.layers.0.mixer.D"].__setitem__(2, np.nan), "non-finite"),
    (lambda t, c: t.__setitem__("backbone.layers.0.mixer.conv1d.weight", np.zeros((12, 4), np.float32)),
     r"conv1d.weight: expected shape \(12, 1, 4\)"),
    (lambda t, c: c.__setitem__("state_size", 4),
     r"x_proj.weight: expected shape \(10, 12\) \(from config.json"),
])
def test_import_refuses_what_we_cannot_represent(change, match):
    t, c = _hf_pair()
    t = {k: v.copy() for k, v in t.items()}
    change(t, c)
    with pytest.raises(ValueError, match=match):
        params_from_hf(t, c)


def test_load_sharded_folder_and_refuse_truncated_file(tmp_path):
    from mamba_ext.io import checkpoint
    p = _our_random_params(9, n_layers=2)
    tensors, hf_cfg = params_to_hf(p, CONFIG)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for fname, keys in shards.items():
        checkpoint.save(tmp_path / fname, {k: tensors[k] for k in keys}, {"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    back, _ = load_hf(tmp_path)
    for k in p:
        np.testing.assert_array_equal(back[k], p[k], err_msg=k)
    first = tmp_path / "model-00001-of-00002.safetensors"
    first.write_bytes(first.read_bytes()[:-4])
    with pytest.raises(ValueError, match="truncated"):
        load_hf(tmp_path)


def test_load_refuses_folder_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hf_pair()[1]))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="safe_serialization"):
        load_hf(tmp_path)


# ---- parity with transformers -------------------------------------------------------------

def _random_hf_model(seed, vocab, hidden, n_layers, state, conv, expand, rank, use_bias,
                     use_conv_bias, eps, emb_std=0.5):
    import torch
    from transformers import MambaConfig, MambaForCausalLM
    cfg = MambaConfig(vocab_size=vocab, hidden_size=hidden, state_size=state, num_hidden_layers=n_layers,
                      conv_kernel=conv, expand=expand, time_step_rank=rank, use_bias=use_bias,
                      use_conv_bias=use_conv_bias, layer_norm_epsilon=eps,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = MambaForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # O(1) random weights, like the golden cases (HF's init is ~0.02)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-2, 2, generator=g)
            elif name.endswith("dt_proj.bias"):
                p.uniform_(-2, 0.5, generator=g)
            elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.normal_(1, 0.2, generator=g)
            elif name.endswith("bias"):
                p.normal_(0, 0.3, generator=g)
            elif name.endswith("embeddings.weight"):
                p.normal_(0, emb_std, generator=g)
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]), generator=g)
    return model


def _ours_from_model(model):
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return params_from_hf(sd, model.config.to_dict())


PARITY_CONFIGS = [
    # seed, vocab, hidden, layers, state, conv, expand, rank, use_bias, use_conv_bias, eps
    (0, 23, 8, 2, 4, 4, 2, "auto", True, True, 1e-5),
    (1, 17, 6, 3, 3, 3, 3, 2, False, False, 1e-5),
    (2, 31, 16, 1, 1, 1, 1, 3, False, True, 1e-6),
    (3, 11, 5, 2, 5, 2, 2, 1, True, False, 1e-3),
]


@pytest.mark.parametrize("conf", PARITY_CONFIGS, ids=lambda c: f"seed{c[0]}")
def test_logits_and_every_gradient_match_transformers(conf):
    _require_transformers()
    import torch
    import torch.nn.functional as F

    from mamba_ext import model_forward, model_loss_and_grads
    model = _random_hf_model(*conf)
    params, cfg = _ours_from_model(model)
    V = cfg["vocab_size"]
    rng = np.random.default_rng(conf[0])
    seq = rng.integers(0, V, (2, 10))
    tokens, targets = seq[:, :-1], seq[:, 1:]

    # theirs: logits, mean CE over all positions (no shift: targets are already shifted), grads.
    # Parameters HF does not have (x_proj bias, head bias, in/out biases when use_bias is off)
    # get their gradient from the gradient of the matching layer output, summed over rows.
    captured = {}

    def keep(name):
        def hook(_module, _inputs, output):
            output.register_hook(lambda g: captured.__setitem__(name, g.sum(dim=(0, 1)).numpy()))
        return hook
    for i, layer in enumerate(model.backbone.layers):
        for mod in ("in_proj", "x_proj", "out_proj"):
            getattr(layer.mixer, mod).register_forward_hook(keep(f"{i}.{mod}"))
    out = model(torch.tensor(tokens), use_cache=False)
    logits_t = out.logits
    logits_t.retain_grad()
    loss_t = F.cross_entropy(logits_t.reshape(-1, V), torch.tensor(targets).reshape(-1))
    loss_t.backward()
    hf_grads = {k: p.grad.numpy() for k, p in model.named_parameters()}
    g_theirs, _ = params_from_hf(hf_grads, model.config.to_dict())   # same linear layout map
    g_theirs["lm_head_bias"] = logits_t.grad.sum(dim=(0, 1)).numpy()
    extra = {"bXProj": "x_proj"} | ({} if conf[8] else {"bInProj": "in_proj", "bOutProj": "out_proj"})
    for i in range(cfg["n_layers"]):
        for ours_name, mod in extra.items():
            g_theirs[f"layer{i}.{ours_name}"] = captured[f"{i}.{mod}"]
    compared = set(g_theirs) - ({f"layer{i}.bConv" for i in range(cfg["n_layers"])}
                                if not conf[9] else set())   # no conv bias in HF: nothing to compare

    kw = {"eps": cfg["eps"], "discretization": cfg["discretization"]}
    logits = model_forward(tokens, params, **kw)
    _assert_close("logits", logits, logits_t.detach().numpy())
    loss, grads = model_loss_and_grads(tokens, targets, params, **kw)
    assert abs(loss - loss_t.item()) <= 1e-6 * abs(loss_t.item())
    assert sorted(grads) == sorted(g_theirs)
    for k in sorted(compared):
        _assert_close(f"grad {k}", grads[k], g_theirs[k])


def test_transformers_checkpoint_loads_and_greedy_generation_matches(tmp_path):
    _require_transformers()
    import torch

    from mamba_ext import model_forward
    from mamba_ext.recurrent import generate
    # a small embedding lets the mixers steer the text (with a large one the residual makes
    # every greedy step repeat the last token, which would test little)
    model = _random_hf_model(7, 37, 12, 2, 4, 4, 2, "auto", False, True, 1e-5, emb_std=0.1)
    model.save_pretrained(tmp_path / "hf")
    params, cfg = load_hf(tmp_path / "hf")
    prompt = np.array([[1, 5, 9, 2], [30, 0, 7, 7]])
    n_new = 24
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompt), max_new_tokens=n_new, do_sample=False,
                                min_new_tokens=0).numpy()[:, prompt.shape[1]:]
    ours = generate(params, prompt, n_new, eps=cfg["eps"], discretization=cfg["discretization"])
    np.testing.assert_array_equal(ours, theirs)
    assert min(len(set(row)) for row in ours) >= 5, f"degenerate test text {ours}"
    # and the full forward agrees with the recurrent path on the generated text
    full = np.concatenate([prompt, ours[:, :-1]], axis=1)
    last = model_forward(full, params, eps=cfg["eps"], discretization=cfg["discretization"])
    np.testing.assert_array_equal(np.argmax(last[:, prompt.shape[1] - 1:], axis=-1), ours)


def test_exported_model_loads_in_transformers_with_same_logits(tmp_path):
    _require_transformers()
    import torch
    from transformers import MambaForCausalLM

    from mamba_ext.recurrent import init_state, step
    p = _our_random_params(8, V=29, Dm=8, D=16, N=4, K=3, R=2, n_layers=2)
    save_hf(tmp_path / "ours", p, CONFIG)
    model = MambaForCausalLM.from_pretrained(tmp_path / "ours").float().eval()
    assert model.config.layer_norm_epsilon == 1e-5 and model.config.use_bias is True
    tokens = np.random.default_rng(8).integers(0, 29, (3, 7))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens), use_cache=False).logits.numpy()
    state = init_state(p, 3, **CONFIG)
    ours = np.stack([step(tokens[:, t], p, state)[0] for t in range(7)], axis=1)
    _assert_close("logits", ours, theirs)


# ---- checkpoints as they are published: float16 / bfloat16, shards (issue 14, part 2) ------

@pytest.mark.parametrize("torch_dtype", ["bfloat16", "float16"])
def test_half_precision_sharded_transformers_checkpoint_loads_up_cast(tmp_path, torch_dtype):
    _require_transformers()
    import torch
    model = _random_hf_model(5, 23, 8, 2, 4, 4, 2, "auto", False, True, 1e-5)
    half = model.to(getattr(torch, torch_dtype))
    half.save_pretrained(tmp_path / "hf", max_shard_size="1KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()     # really sharded
    params, cfg = load_hf(tmp_path / "hf")
    assert cfg["source_dtype"] == torch_dtype
    want, _ = params_from_hf({k: v.float().numpy() for k, v in half.state_dict().items()},
                             half.config.to_dict())
    for k in want:          # the up-cast is exact: every half value is a float32 value
        assert params[k].dtype == np.float32
        np.testing.assert_array_equal(params[k], want[k], err_msg=k)


def test_checkpoint_load_reads_bf16_and_names_it(tmp_path):
    import safetensors.numpy  # noqa: F401  (the test extra has it; it writes no BF16 itself)
    from mamba_ext.io import checkpoint
    x = np.array([[1.0, -2.5, 3.0e38, 1e-3], [np.inf, 0.0, -0.0, 65504.0]], np.float32)
    checkpoint.save(tmp_path / "b.safetensors", {"w": checkpoint.to_bfloat16(x)})
    back, _ = checkpoint.load(tmp_path / "b.safetensors")
    assert back["w"].dtype == np.float32
    assert back["w"][0, 0] == 1.0 and back["w"][0, 1] == -2.5 and np.isinf(back["w"][1, 0])
    np.testing.assert_allclose(back["w"][0, 3], 1e-3, rtol=2 ** -8)
    header = json.loads((tmp_path / "b.safetensors").read_bytes()[8:][:200].split(b"}}")[0] + b"}}")
    assert header["w"]["dtype"] == "BF16"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_save_hf_dtype_and_shards_load_in_transformers(tmp_path, dtype):
    _require_transformers()
    import torch
    from transformers import MambaForCausalLM
    p = _our_random_params(8, V=29, Dm=8, D=16, N=4, K=3, R=2, n_layers=3)
    save_hf(tmp_path / "one", p, CONFIG, dtype=dtype)            # one file
    save_hf(tmp_path / "many", p, CONFIG, dtype=dtype, max_shard_size=1500)
    files = sorted(os.listdir(tmp_path / "many"))
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert sum(f.startswith("model-0") for f in files) > 2
    one, _ = load_hf(tmp_path / "one")
    many, cfg = load_hf(tmp_path / "many")
    assert cfg["source_dtype"] == dtype
    tdt = getattr(torch, dtype)
    for k in p:       # what was written is the dtype's rounding of our values, in either layout
        want = torch.from_numpy(np.ascontiguousarray(p[k], np.float32)).to(tdt).float().numpy()
        if k.endswith("A_log"):
            want = np.clip(want, -10, 5)
        np.testing.assert_array_equal(one[k], many[k], err_msg=k)
        np.testing.assert_array_equal(many[k], want, err_msg=k)
    model = MambaForCausalLM.from_pretrained(tmp_path / "many")
    assert model.dtype == tdt
    sd = model.state_dict()
    np.testing.assert_array_equal(sd["backbone.embeddings.weight"].float().numpy(), many["embedding"])
    # saving again in one file removes the shards of the earlier save
    save_hf(tmp_path / "many", p, CONFIG, dtype=dtype)
    assert sorted(os.listdir(tmp_path / "many")) == ["config.json", "model.safetensors"]


def test_save_hf_refuses_float16_overflow_and_unknown_dtype(tmp_path):
    p = _our_random_params(8)
    p["layer0.wInProj"][0, 0] = 7.0e4
    with pytest.raises(ValueError, match="float16"):
        save_hf(tmp_path / "x", p, CONFIG, dtype="float16")
    with pytest.raises(ValueError, match="dtype"):
        save_hf(tmp_path / "x", p, CONFIG, dtype="int8")
    save_hf(tmp_path / "x", p, CONFIG, dtype="bfloat16")        # bfloat16 has the range


# ---- a real Hugging Face folder end to end: sample --hf, train --init-from ---------------

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    def __init__(self, x, y):\n"
         "        self.x = x\n        self.y = y\n", "for i in range(10):\n    print(i * i)\n"]


def _byte_level_tokenizer():
    """A tiny byte-level BPE tokenizer trained here, offline, on a few strings."""
    tk = optional("tokenizers", "pip install tokenizers (the test extra has it)")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 5, trainer)
    return tok


@pytest.fixture
def hf_folder(tmp_path):
    _require_transformers()
    tok = _byte_level_tokenizer()
    V = tok.get_vocab_size()
    model = _random_hf_model(11, V, 16, 2, 4, 4, 2, "auto", False, True, 1e-5, emb_std=0.1)
    model.save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    return tmp_path / "hf", model, tok


def test_sample_hf_uses_the_checkpoint_tokenizer(hf_folder, capsys):
    import torch

    from mamba_ext.__main__ import main
    path, model, tok = hf_folder
    prompt = "def add(a, b):"
    assert main(["sample", "--hf", str(path), "--prompt", prompt, "--tokens", "12",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    ids = tok.encode(prompt).ids
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                min_new_tokens=0)[0].tolist()
    assert text == tok.decode(theirs) + "\n"
    assert text.startswith(prompt) and len(text) > len(prompt) + 1


def test_sample_hf_prompt_that_is_not_utf8_and_a_tokenizer_without_unk(hf_folder, tmp_path, capsys):
    """Undecodable command-line bytes reach the tokenizer as U+FFFD; a vocabulary that
    cannot encode the prompt gives one clear line (issue 27, point 7)."""
    import subprocess
    import sys
    tk = optional("tokenizers", "pip install tokenizers")
    path, _, _ = hf_folder
    r = subprocess.run([os.fsencode(sys.executable), b"-m", b"mamba_ext", b"sample", b"--hf",
                        os.fsencode(path), b"--prompt", b"ab\xff", b"--tokens", b"2",
                        b"--temperature", b"0"], capture_output=True, timeout=120)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    # a WordLevel vocabulary without an unknown token cannot encode an unseen word
    word = tk.Tokenizer(tk.models.WordLevel({"def": 0, "add": 1}))
    word.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    word.save(str(path / "tokenizer.json"))
    from mamba_ext.__main__ import main
    assert main(["sample", "--hf", str(path), "--prompt", "zzz", "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prompt/--stop: the tokenizer cannot encode") and "[UNK]" in err


def test_train_init_from_fine_tunes_and_exports_a_folder_transformers_loads(hf_folder, tmp_path, capsys):
    import torch
    from transformers import MambaForCausalLM

    from mamba_ext import model_forward
    from mamba_ext.__main__ import main
    from mamba_ext.training.loop import load_training_checkpoint
    path, model, tok = hf_folder
    corpus = tmp_path / "corpus.py"
    corpus.write_text("".join(TEXTS) * 30)
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(path), "--data", str(corpus), "--steps", "6",
                 "--seq-len", "16", "--batch", "2", "--lr", "3e-3", "--out", str(out), "--quiet"]) == 0
    ck = load_training_checkpoint(out / "checkpoint.safetensors")
    cfg = ck["config"]
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.discretization) == (
        tok.get_vocab_size(), 16, 2, "euler")
    start, _ = load_hf(path)
    params = ck["params"]
    assert not np.array_equal(params["layer0.wInProj"], start["layer0.wInProj"])    # it trained
    assert not params["lm_head_bias"].any() and not params["layer1.bXProj"].any()    # frozen at 0
    # the exported folder: transformers loads it and computes our logits; the tokenizer is there
    hf_out = out / "hf"
    assert (hf_out / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    tuned = MambaForCausalLM.from_pretrained(hf_out).float().eval()
    ids = np.array([tok.encode("class Point:").ids])
    with torch.no_grad():
        theirs = tuned(torch.tensor(ids), use_cache=False).logits.numpy()
    ours = model_forward(ids, params, eps=cfg.eps, discretization="euler")
    _assert_close("logits", ours, theirs)
    # and sample reads the run with that tokenizer
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(out), "--prompt", "def", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def")
