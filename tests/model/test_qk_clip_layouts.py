"""QK-clip layouts (``instability_watch.act.qkclip``) checked against real models we did not write.

For every model family, one attention layer at a time: the q, k and v tensors each
layer hands to ``F.scaled_dot_product_attention`` are recorded (a
``TorchFunctionMode`` that passes every call through; no watch is attached, so
nothing else patches SDPA), ``QKProjections.apply(gamma)`` scales that layer, the same
batch is run again, and then:

* query head ``h`` is scaled by ``fq[h]`` (``sqrt(gamma[h])`` with one key head per
  query head, ``gamma[h]`` with grouped keys); RoPE is linear, so it passes through;
* keys: scaled by ``sqrt(gamma)`` (multi-head), bitwise unchanged (grouped keys,
  whether SDPA gets ``KV`` heads with ``enable_gqa`` or ``H`` repeated ones);
* the logits ``scale * q.k`` of head ``h`` (float64 from the recorded tensors) are
  multiplied by exactly ``gamma[h]``;
* heads with ``gamma == 1`` and the values are bitwise unchanged;
* every parameter other than the layer's query/key rows (value rows of fused
  projections included) is bitwise unchanged.

The layer scaled is the first whose parameters differ, so its inputs are the same
in both forwards. Biases are randomised first (the libraries initialise them to
zero, which would hide a bias left unscaled).

Then the public API: ``InstabilityWatch(model, WatchConfig(qk_clip=...))`` refuses
QK-norm models and user-described layers without ``w_k`` or with copies, and clips
a user-described layer with ``w_k``/``b_q``/``b_k``.
"""
from __future__ import annotations

import importlib.util
import math
import os
from typing import Callable, Dict, List, NamedTuple, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from instability_watch import AttentionLayer, InstabilityWatch, WatchConfig
from instability_watch.model.families import qk_projections as build_layouts
from instability_watch.model.layer import resolve_layers

import family_models
import real_models
from helpers import REPO
from nanogpt import GPT, GPTConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NANOGPT_PY = REPO / ".thirdparty" / "nanogpt_model.py"
BASE_GAMMA = (1.0, 0.25, 0.5, 0.81, 1.0, 0.64, 0.9, 1.0)  # cycled over the heads, rolled per layer


# ----------------------------------------------------------------------------- recording SDPA


class Call(NamedTuple):
    layer: int  # index into the resolved layers (-1: outside every watched layer)
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float


class RecordSDPA(TorchFunctionMode):
    """Records q, k, v (copies) and the scale of every SDPA call, tagged with the innermost watched layer."""

    def __init__(self, stack: List[int]) -> None:
        super().__init__()
        self.stack = stack
        self.calls: List[Call] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
            if scale is None:
                scale = 1.0 / math.sqrt(q.shape[-1])
            self.calls.append(Call(self.stack[-1] if self.stack else -1, q.detach().clone(), k.detach().clone(),
                                   v.detach().clone(), float(scale)))
        return func(*args, **kwargs)


def record(model: nn.Module, layers, forward: Callable[[nn.Module], object]) -> List[Call]:
    stack: List[int] = []
    handles = []

    def leave(module, args, output):
        stack.pop()  # returns None: the output stays

    for i, layer in enumerate(layers):
        handles.append(layer.module.register_forward_pre_hook(lambda m, a, i=i: stack.append(i)))
        handles.append(layer.module.register_forward_hook(leave))
    try:
        with torch.no_grad(), RecordSDPA(stack) as rec:
            forward(model)
    finally:
        for h in handles:
            h.remove()
    assert not stack
    return rec.calls


# ----------------------------------------------------------------------------- the models and their layouts


class Case(NamedTuple):
    build: Callable[[], nn.Module]
    forward: Callable[[nn.Module], object]  # runs a fixed batch
    heads: int
    kv: int  # key heads (== heads: multi-head)
    layers: int
    # given the attention module: {parameter name under it: None (all query/key rows) or a function returning
    # the slice of the tensor that must NOT change (value rows of a fused projection)}
    qk_params: Callable[[nn.Module], Dict[str, Optional[Callable[[torch.Tensor], torch.Tensor]]]]
    attention_layers: Optional[Callable[[nn.Module], list]] = None  # user-described layers (None: locators)


def _batch_forward(spec):
    def run(model):
        return spec.loss(model, spec.batch(torch.Generator().manual_seed(1)))
    return run


def _pair(q: str, k: str):
    """Separate query and key modules: both whole, biases included."""
    return lambda m: {f"{q}.weight": None, f"{q}.bias": None, f"{k}.weight": None, f"{k}.bias": None}


def _nanogpt_qk(m):  # c_attn (3E, E): [Q | K | V] rows
    e = m.c_attn.in_features
    return {"c_attn.weight": lambda t: t[2 * e:], "c_attn.bias": lambda t: t[2 * e:]}


def _gpt2_qk(m):  # Conv1D c_attn (E, 3E): [Q | K | V] columns; cross-attention: q_attn (E, E), c_attn (E, 2E) [K | V]
    if getattr(m, "is_cross_attention", False):
        e = m.q_attn.weight.shape[1]
        return {"q_attn.weight": None, "q_attn.bias": None,
                "c_attn.weight": lambda t: t[:, e:], "c_attn.bias": lambda t: t[e:]}
    e = m.c_attn.weight.shape[0]
    return {"c_attn.weight": lambda t: t[:, 2 * e:], "c_attn.bias": lambda t: t[2 * e:]}


def _grouped_qk(heads: int, kv: int):
    """A fused query_key_value grouped per key head: rows (KV, H / KV + 2, D), the value head last."""
    per = heads // kv

    def value(t):
        return t.reshape(kv, per + 2, -1, *t.shape[1:])[:, -1]
    return lambda m: {"query_key_value.weight": value, "query_key_value.bias": value}


def _queries_first_qk(attr: str, heads: int, kv: int, d: int):
    """A fused projection [Q (H D) | K (KV D) | V (KV D)]."""
    def value(t):
        return t[(heads + kv) * d:]
    return lambda m: {f"{attr}.weight": value, f"{attr}.bias": value}


def _family(name: str, kv: int, qk) -> Case:
    spec = family_models.FAMILIES[name]
    return Case(spec.build, _batch_forward(spec), spec.heads, kv, spec.layers, qk)


def _real(name: str, kv: int, qk) -> Case:
    spec = real_models.MODELS[name]
    return Case(spec.build, _batch_forward(spec), spec.heads, kv, spec.layers, qk)


def _nanogpt_package_bias() -> nn.Module:
    return GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=8, n_embd=64, bias=True, dropout=0.1))


def _nanogpt_forward(model):
    x = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    return model(x, x)


def _karpathy_nanogpt() -> nn.Module:
    if not NANOGPT_PY.exists():
        pytest.skip(f"nanoGPT's model.py not at {NANOGPT_PY}")
    spec = importlib.util.spec_from_file_location("nanogpt_model_qkclip", NANOGPT_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.GPTConfig(block_size=32, vocab_size=97, n_layer=2, n_head=4, n_embd=64, dropout=0.1, bias=True)
    return mod.GPT(cfg)


def _gpt2_cross() -> nn.Module:
    t = pytest.importorskip("transformers")
    cfg = t.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=32, vocab_size=97, bos_token_id=0,
                       eos_token_id=0, add_cross_attention=True, attn_implementation="sdpa")
    return t.GPT2LMHeadModel(cfg)


def _gpt2_cross_forward(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 97, (2, 32), generator=g)
    enc = torch.randn(2, 7, 64, generator=g)  # an encoder output of another length
    return model(input_ids=x, encoder_hidden_states=enc)


class SeparateQKV(nn.Module):
    """User code: separate wq/wk/wv with biases, ``kv`` key heads (``enable_gqa`` when fewer than the queries)."""

    def __init__(self, e: int, heads: int, kv: int) -> None:
        super().__init__()
        self.heads, self.kv, self.d = heads, kv, e // heads
        self.wq = nn.Linear(e, heads * self.d)
        self.wk = nn.Linear(e, kv * self.d)
        self.wv = nn.Linear(e, kv * self.d)
        self.wo = nn.Linear(heads * self.d, e)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.heads, self.d).transpose(1, 2)
        k = self.wk(x).view(b, n, self.kv, self.d).transpose(1, 2)
        v = self.wv(x).view(b, n, self.kv, self.d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv < self.heads)
        return self.wo(y.transpose(1, 2).reshape(b, n, -1))


class TinyLM(nn.Module):
    def __init__(self, heads: int = 4, kv: int = 2, e: int = 32, n_layer: int = 2, vocab: int = 97) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, e)
        self.blocks = nn.ModuleList(SeparateQKV(e, heads, kv) for _ in range(n_layer))
        self.norm = nn.LayerNorm(e)
        self.head = nn.Linear(e, vocab)

    def forward(self, x, y=None):
        h = self.emb(x)
        for blk in self.blocks:
            h = h + blk(self.norm(h))
        logits = self.head(h)
        return logits if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())


def user_layers(model: TinyLM, biases: bool = True, clone: str = "") -> List[AttentionLayer]:
    """``AttentionLayer(w_q, w_k, b_q, b_k)`` views for TinyLM (``clone``: that one returns a copy)."""
    out = []
    for blk in model.blocks:
        a = blk
        e = a.wq.in_features

        def get(fn, name):
            return (lambda: fn().clone()) if name == clone else fn
        kw = dict(w_k=get(lambda a=a: a.wk.weight.view(a.kv, a.d, e), "w_k"))
        if biases:
            kw.update(b_q=get(lambda a=a: a.wq.bias.view(a.heads, a.d), "b_q"),
                      b_k=get(lambda a=a: a.wk.bias.view(a.kv, a.d), "b_k"))
        out.append(AttentionLayer(a, a.heads, get(lambda a=a: a.wq.weight.view(a.heads, a.d, e), "w_q"), **kw))
    return out


def _tiny_forward(model):
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    return model(x, x)


CASES: Dict[str, Case] = {
    # tests/family_models.py
    "hf-gpt-neox": _family("hf-gpt-neox", 4, _grouped_qk(4, 4)),
    "hf-phi3-gqa": _family("hf-phi3-gqa", 2, _queries_first_qk("qkv_proj", 4, 2, 8)),
    "hf-falcon-gqa": _family("hf-falcon-gqa", 2, _grouped_qk(4, 2)),
    "hf-t5": _family("hf-t5", 4, _pair("q", "k")),
    "timm-vit": _family("timm-vit", 4, _queries_first_qk("qkv", 4, 4, 8)),
    "litgpt-gqa": _family("litgpt-gqa", 2, _queries_first_qk("qkv", 4, 2, 8)),
    # tests/real_models.py (nanogpt-dropout is the package's own GPT)
    "nanogpt-dropout": _real("nanogpt-dropout", 4, _nanogpt_qk),
    "hf-gpt2-default": _real("hf-gpt2-default", 4, _gpt2_qk),
    "hf-llama-gqa": _real("hf-llama-gqa", 2, _pair("q_proj", "k_proj")),
    "hf-mistral-sliding-window": _real("hf-mistral-sliding-window", 2, _pair("q_proj", "k_proj")),
    "hf-bert-padding": _real("hf-bert-padding", 4, _pair("query", "key")),
    # more
    "nanogpt-package-bias-8-heads": Case(_nanogpt_package_bias, _nanogpt_forward, 8, 8, 2, _nanogpt_qk),
    "karpathy-nanogpt": Case(_karpathy_nanogpt, _nanogpt_forward, 4, 4, 2, _nanogpt_qk),
    # 2 self-attention, 2 cross-attention layers
    "hf-gpt2-cross-attention": Case(_gpt2_cross, _gpt2_cross_forward, 4, 4, 4, _gpt2_qk),
    "user-gqa": Case(lambda: TinyLM(4, 2), _tiny_forward, 4, 2, 2, _pair("wq", "wk"), user_layers),
    "user-mha": Case(lambda: TinyLM(4, 4), _tiny_forward, 4, 4, 2, _pair("wq", "wk"), user_layers),
}


def gamma_for(heads: int, layer: int) -> torch.Tensor:
    g = torch.tensor([BASE_GAMMA[i % len(BASE_GAMMA)] for i in range(heads)], dtype=torch.float32)
    return torch.roll(g, layer)


def built(case: Case) -> nn.Module:
    torch.manual_seed(0)
    model = case.build().float().eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # zero at init in most libraries: would hide an unscaled bias
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


# ----------------------------------------------------------------------------- checks


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual, expected = actual.double(), expected.double()
    atol = 1e-6 * float(expected.abs().max().clamp_min(1e-30))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def check_call(before: Call, after: Call, gamma: torch.Tensor, heads: int, kv: int, where: str) -> None:
    """One SDPA call of the scaled layer, before and after ``apply(gamma)``."""
    g = gamma.double()
    fq = g if kv < heads else g.sqrt()
    q0, q1, k0, k1 = before.q, after.q, before.k, after.k
    assert q0.shape == q1.shape and q0.shape[1] == heads, f"{where}: q {tuple(q0.shape)}"
    assert k0.shape == k1.shape and k0.shape[1] in (kv, heads), f"{where}: k {tuple(k0.shape)} ({kv} key heads)"
    assert before.scale == after.scale
    assert torch.equal(before.v, after.v), f"{where}: the values changed"
    rep = heads // k0.shape[1]  # query heads per key head as SDPA sees them (H when repeated to H)
    for h in range(heads):
        tag = f"{where} head {h} (gamma {float(g[h]):g})"
        _close(q1[:, h], q0[:, h] * fq[h], f"{tag}: q")
        if g[h] == 1.0:
            assert torch.equal(q1[:, h], q0[:, h]), f"{tag}: q not bitwise unchanged"
        kh = h // rep
        if kv < heads:
            assert torch.equal(k1[:, kh], k0[:, kh]), f"{tag}: a shared key head changed"
        else:
            _close(k1[:, kh], k0[:, kh] * g[h].sqrt(), f"{tag}: k")
            if g[h] == 1.0:
                assert torch.equal(k1[:, kh], k0[:, kh]), f"{tag}: k not bitwise unchanged"
        qd, kd = q0[:, h].double(), k0[:, kh].double().transpose(-1, -2)
        s0 = before.scale * qd @ kd
        s1 = after.scale * q1[:, h].double() @ k1[:, kh].double().transpose(-1, -2)
        # float32 q and k: each logit is exact to ~1e-7 of scale * sum_d |q_d k_d| (the sum cancels; tiny models
        # have small logits), so the tolerance is 1e-5 of that, elementwise, on top of rtol 1e-5
        magnitude = before.scale * qd.abs() @ kd.abs()
        err = (s1 - s0 * g[h]).abs()
        allowed = 1e-5 * (s0 * g[h]).abs() + 1e-5 * g[h] * magnitude
        assert (err <= allowed).all(), (f"{tag}: logits not scaled by gamma: worst error {float(err.max()):.3g}, "
                                        f"{float((err / allowed).max()):.3g} times the tolerance")
        assert s0.abs().max() > 1e-3  # the logits are not trivially zero
    if kv < heads:
        assert torch.equal(k1, k0), f"{where}: grouped keys changed"


def check_parameters(before: Dict[str, torch.Tensor], after: Dict[str, torch.Tensor], prefix: str,
                     qk: Dict[str, Optional[Callable]], where: str) -> int:
    """Everything but the layer's query/key rows bitwise unchanged; returns how many tensors held q/k rows."""
    held = 0
    for key, t0 in before.items():
        t1 = after[key]
        rel = key[len(prefix):] if key.startswith(prefix) else None
        if rel in qk:
            held += 1
            keep = qk[rel]
            if keep is not None:
                assert torch.equal(keep(t1), keep(t0)), f"{where}: the value rows of {key} changed"
        else:
            assert torch.equal(t1, t0), f"{where}: {key} changed"
    return held


@pytest.mark.parametrize("name", list(CASES))
def test_layout_scales_each_heads_logits_by_gamma_in_the_real_model(name):
    case = CASES[name]
    model = built(case)
    layers = resolve_layers(model, case.attention_layers(model) if case.attention_layers else None)
    assert len(layers) == case.layers
    layouts = build_layouts(layers, model)
    assert len(layouts) == len(layers)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i, (layer, layout) in enumerate(zip(layers, layouts)):
        where = f"{name} {layer.name}"
        assert (layer.num_heads, layout.num_heads, layout.num_kv) == (case.heads, case.heads, case.kv), where
        model.load_state_dict(state)  # in place: the layouts find the same tensors
        calls0 = record(model, layers, case.forward)
        gamma = gamma_for(case.heads, i)
        if case.kv < case.heads:  # a shared key group with a head at 1 and one not
            groups = gamma.view(case.kv, -1)
            assert (((groups == 1).any(1)) & ((groups != 1).any(1))).any()
        layout.apply(gamma.clone())
        after = model.state_dict()
        calls1 = record(model, layers, case.forward)
        mine0 = [c for c in calls0 if c.layer == i]
        mine1 = [c for c in calls1 if c.layer == i]
        assert len(mine0) == len(mine1) >= 1, f"{where}: SDPA calls {len(mine0)} then {len(mine1)}"
        for c0, c1 in zip(mine0, mine1):
            check_call(c0, c1, gamma, case.heads, case.kv, where)
        # layers that ran before it saw nothing change
        for c0, c1 in zip(calls0, calls1):
            if c0.layer == i:
                break
            assert torch.equal(c0.q, c1.q) and torch.equal(c0.k, c1.k), f"{where}: an earlier call changed"
        held = check_parameters(state, after, layer.name + ".", case.qk_params(layer.module), where)
        assert held >= 1, f"{where}: no query/key parameter found under {layer.name}"
        # the tensors the layout scales are exactly the layer's query/key parameters (biases included)
        storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
        expected = {storage(after[layer.name + "." + n]) for n in case.qk_params(layer.module)
                    if layer.name + "." + n in after}
        assert {storage(p) for p in layout.parameters()} == expected, where
    model.load_state_dict(state)


def test_gamma_one_everywhere_changes_no_bit():
    for name in ("hf-gpt2-cross-attention", "hf-falcon-gqa", "hf-t5"):
        case = CASES[name]
        model = built(case)
        layers = resolve_layers(model, None)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for layout in build_layouts(layers, model):
            layout.apply(torch.ones(layout.num_heads))
        for k, v in model.state_dict().items():
            assert torch.equal(v, state[k]), f"{name}: {k}"


# ----------------------------------------------------------------------------- the public API


def _qk_norm_model() -> nn.Module:
    t = pytest.importorskip("transformers")
    for cfg_name, model_name in (("Qwen3Config", "Qwen3ForCausalLM"), ("Olmo2Config", "Olmo2ForCausalLM")):
        if hasattr(t, cfg_name) and hasattr(t, model_name):
            cfg_cls = getattr(t, cfg_name)
            kw = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                      intermediate_size=64, vocab_size=97, max_position_embeddings=32, attn_implementation="sdpa")
            if cfg_name == "Qwen3Config":
                kw["head_dim"] = 8
            torch.manual_seed(0)
            return getattr(t, model_name)(cfg_cls(**kw)).eval()
    pytest.skip("neither Qwen3 nor OLMo2 (models with q_norm/k_norm) in the installed transformers")


def test_qk_norm_model_is_refused_with_qk_clip_and_attaches_without():
    model = _qk_norm_model()
    for mode in ("always", "on_alert"):
        with pytest.raises(ValueError, match="QK-norm") as err:
            InstabilityWatch(model, WatchConfig(qk_clip=mode))
        assert "q_norm" in str(err.value) and "layers.0" in str(err.value)
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x).logits
    watch = InstabilityWatch(model, WatchConfig(qk_clip=None))
    try:
        assert watch.active and len(watch.layer_names) == 2
        with torch.no_grad():
            out = model(x).logits
    finally:
        watch.detach()
    torch.testing.assert_close(out, ref)


def test_user_layer_without_w_k_is_refused_only_with_qk_clip():
    model = TinyLM(4, 2)
    bare = lambda m: [AttentionLayer(b, b.heads, lambda b=b: b.wq.weight.view(b.heads, b.d, -1))  # noqa: E731
                      for b in m.blocks]
    with pytest.raises(ValueError, match="w_k"):
        InstabilityWatch(model, WatchConfig(qk_clip="always"), layers=bare)
    watch = InstabilityWatch(model, WatchConfig(), layers=bare)
    assert watch.active
    watch.detach()
    with pytest.raises(ValueError, match="w_k"):  # biases without w_k: a mistake either way
        AttentionLayer(model.blocks[0], 4, lambda: model.blocks[0].wq.weight.view(4, 8, 32),
                       b_q=lambda: model.blocks[0].wq.bias.view(4, 8))


@pytest.mark.parametrize("copy", ["w_q", "w_k", "b_q", "b_k"])
def test_user_layer_returning_a_copy_is_refused(copy):
    model = TinyLM(4, 2)
    with pytest.raises(ValueError, match="view"):
        InstabilityWatch(model, WatchConfig(qk_clip="always"), layers=user_layers(model, clone=copy))


@pytest.mark.parametrize("kv", [2, 4])
def test_user_layer_with_w_k_is_clipped_through_the_watch(kv):
    """Attach with qk_clip="always" and a tau between the heads' largest logits; one probe step, no optimizer:
    the clipped heads' logits scale by tau / S (their largest logit comes back to tau), the others keep every bit."""
    torch.manual_seed(0)
    model = TinyLM(4, kv).float()
    with torch.no_grad():  # large logits, one head per layer small
        for blk in model.blocks:
            blk.wq.weight.mul_(4.0)
            blk.wk.weight.mul_(4.0)
            blk.wq.weight.view(4, blk.d, -1)[2].mul_(0.05)
            blk.wq.bias.view(4, blk.d)[2].mul_(0.05)
    layers = user_layers(model)
    found = resolve_layers(model, layers)
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    causal = torch.ones(24, 24, dtype=torch.bool).tril()

    def max_logits(calls):
        out = []
        for c in calls:
            rep = c.q.shape[1] // c.k.shape[1]
            k = c.k.double().repeat_interleave(rep, dim=1)
            s = (c.scale * c.q.double() @ k.transpose(-1, -2)).masked_fill(~causal, float("-inf"))
            out.append(s.amax(dim=(0, 2, 3)))
        return torch.stack(out)  # (L, H)

    calls0 = record(model, found, lambda m: m(x))
    s0 = max_logits(calls0)
    assert s0[:, 2].max() < s0[:, [0, 1, 3]].min() / 2
    tau = float(s0[:, 2].max() + s0[:, [0, 1, 3]].min()) / 2  # only the small head stays under it
    state = {k: v.clone() for k, v in model.state_dict().items()}

    watch = InstabilityWatch(model, WatchConfig(qk_clip="always", qk_clip_tau=tau, probe_every=1, shadow_every=0,
                                                spectral_every=0, log_every=1, warmup_steps=0), layers=layers)
    model.train()
    loss = model(x, x)
    loss.backward()
    model.zero_grad(set_to_none=True)
    watch.step(loss.detach())
    watch.flush()
    clips = {(c.layer, c.head): c for c in watch.last_clips}
    watch.detach()
    model.eval()

    assert set(clips) == {(layer, h) for layer in range(2) for h in (0, 1, 3)}
    gamma = torch.ones(2, 4)
    for (layer, h), c in clips.items():
        torch.testing.assert_close(c.max_logit, float(s0[layer, h]), rtol=1e-4, atol=0)
        gamma[layer, h] = c.factor
    torch.testing.assert_close(gamma, (tau / s0).clamp(max=1.0).float(), rtol=1e-4, atol=0)
    # the first layer's inputs are unchanged: check its call as above; every layer's largest logit is now tau
    calls1 = record(model, found, lambda m: m(x))
    check_call(calls0[0], calls1[0], gamma[0], 4, kv, f"user kv={kv} layer 0")
    torch.testing.assert_close(max_logits(calls1)[0], torch.minimum(s0[0], torch.tensor(tau, dtype=torch.float64)),
                               rtol=1e-4, atol=0)
    # only the query/key weights and biases moved
    after = model.state_dict()
    for k, v in state.items():
        if k.split(".")[-2] in ("wq", "wk"):
            continue
        assert torch.equal(after[k], v), k
    for i, blk in enumerate(model.blocks):  # the weights themselves: head 1 scaled, head 2 (under tau) untouched
        wq0, wq1 = state[f"blocks.{i}.wq.weight"].view(4, blk.d, -1), blk.wq.weight.detach().view(4, blk.d, -1)
        fq = gamma[i] if kv < 4 else gamma[i].sqrt()
        torch.testing.assert_close(wq1[1], wq0[1] * fq[1], rtol=1e-6, atol=0)
        assert torch.equal(wq1[2], wq0[2])
        if kv < 4:
            assert torch.equal(blk.wk.weight, state[f"blocks.{i}.wk.weight"])
            assert torch.equal(blk.wk.bias, state[f"blocks.{i}.wk.bias"])
