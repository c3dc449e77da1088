"""use_in_transformers and Mamba against transformers' own torch path (an implementation
nobody here wrote): hidden states, logits, loss, every parameter gradient, greedy
generate; Mamba's state dict with transformers' MambaMixer (the names of mamba_ssm)."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
from conftest import optional

torch = optional("torch", "the PyTorch interface needs torch (pip install torch)")
transformers = optional("transformers", "the transformers interop needs transformers")
from transformers import MambaConfig, MambaForCausalLM, MambaModel  # noqa: E402

from mamba_ext.torch import Mamba, restore, use_in_transformers  # noqa: E402

CONFIGS = [dict(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=2, conv_kernel=4,
                expand=2, time_step_rank=3),
           dict(vocab_size=37, hidden_size=12, state_size=3, num_hidden_layers=1, conv_kernel=3,
                expand=3, time_step_rank=2, use_bias=True, use_conv_bias=False)]


def _pair(cfg, dtype, seed=0):
    torch.manual_seed(seed)
    ref = MambaForCausalLM(MambaConfig(**cfg)).to(dtype)
    with torch.no_grad():          # away from the default init, so every term matters
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ref, use_in_transformers(copy.deepcopy(ref))


def _rel_finite(a, b):
    """_rel over the finite entries (min_new_tokens sets the EOS score to -inf), which
    must be the same in both."""
    keep = torch.isfinite(b)
    assert torch.equal(keep, torch.isfinite(a))
    return _rel(a[keep], b[keep])


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _greedy(models, prompt, n):
    """Each model's greedy generate of exactly n tokens after prompt, with every step's scores
    (in eval mode, without autograd: the decode steps run as one compiled call per mixer
    where the weights allow, hf._decode_step)."""
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, return_dict_in_generate=True,
              output_scores=True)
    with torch.no_grad():
        return [m.eval().generate(prompt, **kw) for m in models]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_training_step_matches_the_torch_path(cfg, dtype):
    """float64: hidden states and gradients to 1e-6 relative to their max (not 1e-9), because
    transformers' torch path itself rounds B and u to float32 in mamba_selective_scan
    (``B[:, None, :, :].float()``, ``hidden_states[..., None].float()``) and A, D,
    dt_proj's bias in the mixer (``.float()``); our own float64 exactness is shown by
    test_functions.py (1e-12 against a float64 reference, gradcheck). float32: 1e-4."""
    ref, ours = _pair(cfg, dtype)
    ids = torch.randint(0, cfg["vocab_size"], (3, 41), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (ref, ours):
        m.train()
        h = m.backbone(ids).last_hidden_state
        out = m(ids, labels=ids)
        out.loss.backward()
        outs.append((h, out))
    (h1, o1), (h2, o2) = outs
    tol_h, tol_g = (1e-6, 1e-6) if dtype == torch.float64 else (1e-4, 1e-4)
    assert _rel(h2, h1) <= tol_h
    assert _rel(o2.logits, o1.logits) <= max(tol_h, 1e-6)      # logits are float32 in transformers
    assert abs(o2.loss.item() - o1.loss.item()) <= 1e-5 * abs(o1.loss.item())
    n = 0
    for (name, p), (name2, p2) in zip(ref.named_parameters(), ours.named_parameters()):
        assert name == name2 and p2.grad is not None, name
        assert _rel(p2.grad, p.grad) <= tol_g, (name, _rel(p2.grad, p.grad))
        n += 1
    assert n == len(list(ref.parameters()))


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_matches_the_torch_path(cfg, dtype):
    """A model in bfloat16 / float16 (as from_pretrained(torch_dtype=...) gives it): our
    kernels run in float32 (mamba_ext.torch's half inputs), transformers' torch path in its
    own mix of the two; loss, logits and every gradient agree to the half type's rounding."""
    ref, ours = _pair(cfg, dtype)
    ids = torch.randint(0, cfg["vocab_size"], (3, 41), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (ref, ours):
        m.train()
        out = m(ids, labels=ids)
        out.loss.backward()
        outs.append(out)
    fi = torch.finfo(dtype)
    assert abs(outs[1].loss.item() - outs[0].loss.item()) <= 2 * fi.eps * abs(outs[0].loss.item())
    assert _rel(outs[1].logits.float(), outs[0].logits.float()) <= 8 * fi.eps
    sub = fi.smallest_normal * fi.eps     # float16's subnormal step: tiny gradients (dt_proj's
    for (name, p), p2 in zip(ref.named_parameters(), ours.parameters()):     # bias) sit there
        assert p2.grad is not None and p2.grad.dtype == dtype, name
        g, g2 = p.grad.float(), p2.grad.float()
        assert (g2 - g).norm().item() <= 16 * fi.eps * g.norm().item() + 64 * sub * g.numel() ** 0.5, name


def test_greedy_generate_gives_the_same_tokens():
    ref, ours = _pair(CONFIGS[0], torch.float32, seed=2)
    prompt = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(3))
    a, b = _greedy((ref, ours), prompt, 20)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):          # the logits of every step
        assert _rel_finite(sb, sa) <= 1e-5
    with torch.no_grad():
        assert _rel(ours(prompt).logits, ref(prompt).logits) <= 1e-5     # eval forward, no cache


def test_decode_step_advances_the_cache_like_transformers():
    """One compiled mixer step per token (float64 weights): the conv and recurrent states
    after prefill + steps equal transformers' own."""
    ref, ours = _pair(CONFIGS[1], torch.float64, seed=6)
    prompt = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(7))
    a, b = _greedy((ref, ours), prompt, 6)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        assert _rel_finite(sb, sa) <= 1e-6
    assert "_mamba_ext_layer" in vars(ours.backbone.layers[0].mixer)     # the compiled step ran
    with torch.no_grad():              # changed weights (in place, or a new Parameter) are seen
        for m in (ref, ours):
            m.backbone.layers[0].mixer.out_proj.weight.mul_(1.5)
            m.backbone.layers[0].mixer.in_proj.weight = torch.nn.Parameter(
                m.backbone.layers[0].mixer.in_proj.weight * 0.5)
    a, b = _greedy((ref, ours), prompt, 6)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        assert _rel_finite(sb, sa) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_generate_matches_transformers(dtype):
    """Half weights: each token takes the general path (our conv and scan steps in float32;
    the one-call step, which would read float32 copies of the weights, ran no faster); every
    step's scores within the half type's rounding, the same tokens."""
    ref, ours = _pair(CONFIGS[0], dtype, seed=6)
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(7))
    a, b = _greedy((ref, ours), prompt, 10)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        assert sb.dtype == sa.dtype
        assert _rel_finite(sb.float(), sa.float()) <= 4 * torch.finfo(dtype).eps


def test_padding_mask_takes_transformers_masked_path():
    ref, ours = _pair(CONFIGS[0], torch.float64, seed=4)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    ref.train()
    ours.train()
    assert _rel(ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits) <= 1e-6


def test_patch_is_scoped_to_the_model_and_restorable():
    ref, ours = _pair(CONFIGS[0], torch.float32)
    other = MambaForCausalLM(MambaConfig(**CONFIGS[0]))
    assert "forward" in vars(ours.backbone.layers[0].mixer)
    assert "forward" not in vars(ref.backbone.layers[0].mixer)
    assert "forward" not in vars(other.backbone.layers[0].mixer)
    restore(ours)
    assert "forward" not in vars(ours.backbone.layers[0].mixer)
    bare = use_in_transformers(MambaModel(MambaConfig(**CONFIGS[0])))   # a MambaModel too
    assert "forward" in vars(bare.layers[0].mixer)


def test_bad_models_are_refused():
    with pytest.raises(TypeError, match="model"):
        use_in_transformers("not a model")
    with pytest.raises(ValueError, match="no MambaMixer"):
        use_in_transformers(torch.nn.Linear(2, 2))
    model = MambaForCausalLM(MambaConfig(**CONFIGS[0]))
    model.lm_head.weight = torch.nn.Parameter(torch.zeros(50, 16, dtype=torch.complex64))
    with pytest.raises(TypeError, match="floating parameters"):
        use_in_transformers(model)


def test_no_fallback_warning_for_what_we_replaced():
    code = ("import torch\n"
            "from transformers import MambaConfig, MambaForCausalLM\n"
            "from mamba_ext.torch import use_in_transformers\n"
            "m = use_in_transformers(MambaForCausalLM(MambaConfig(vocab_size=20, hidden_size=8, "
            "state_size=2, num_hidden_layers=1)))\n"
            "ids = torch.randint(0, 20, (1, 6))\n"
            "m.train(); m(ids, labels=ids).loss.backward()\n"
            "m.eval(); m.generate(ids, max_new_tokens=3, do_sample=False)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "falling back" not in out.stderr + out.stdout


def test_mamba_layer_state_dict_moves_both_ways_with_transformers_mixer():
    from transformers.models.mamba.modeling_mamba import MambaMixer
    torch.manual_seed(0)
    ours = Mamba(d_model=12, d_state=4, d_conv=3, expand=2, dt_rank=2, layer_idx=0).double()
    cfg = MambaConfig(hidden_size=12, state_size=4, conv_kernel=3, expand=2, time_step_rank=2,
                      num_hidden_layers=1, use_bias=False, use_conv_bias=True)
    mixer = MambaMixer(cfg, layer_idx=0).double()
    sd = ours.state_dict()
    assert set(sd) == {"in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight",
                       "dt_proj.weight", "dt_proj.bias", "A_log", "D", "out_proj.weight"}
    shapes = {k: tuple(v.shape) for k, v in mixer.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in sd.items()} == shapes
    mixer.load_state_dict(sd)
    x = torch.randn(2, 17, 12, dtype=torch.float64)
    want = mixer(x)                      # transformers' own torch path (eval, no cache)
    ours.train()
    assert _rel(ours(x), want) <= 1e-6
    back = Mamba(d_model=12, d_state=4, d_conv=3, expand=2, dt_rank=2).double()
    back.load_state_dict(mixer.state_dict())
    assert torch.equal(back(x), ours(x))


def test_mamba_layer_step_continues_the_prefill():
    class Params:                        # mamba_ssm's InferenceParams, the fields used
        def __init__(self):
            self.key_value_memory_dict, self.seqlen_offset = {}, 0
    torch.manual_seed(1)
    m = Mamba(d_model=8, d_state=3, d_conv=4, layer_idx=0).double()
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    full = m(x)
    p = Params()
    out = [m(x[:, :6], inference_params=p)]
    for t in range(6, 10):
        p.seqlen_offset = t
        out.append(m(x[:, t:t + 1], inference_params=p))
    assert torch.allclose(torch.cat(out, 1), full, atol=1e-12)
    with pytest.raises(ValueError, match="hidden_states"):
        m(torch.zeros(2, 3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="device"):
        Mamba(8, device="cuda")
