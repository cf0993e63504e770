"""Switched heads run on our kernels: the issue's CPU acceptance.

"Switch a head with ``watch.switch(layer, head)``, then train: HF BERT with a
padding mask, HF Mistral with a sliding window, HF GPT-2 with dropout 0.1, and
T5. Coverage shows ``kernel_calls`` > 0 and no refused switch. Outputs and
gradients of masked and dropout calls stay within twice PyTorch's own BF16
error against float64. For dropout, compare with the mask fixed by the seed
against a reference that applies the same mask; also check the dropped
fraction and the scale statistically."

1. The four models train 3 steps under CPU bf16 autocast with head 0 of every
   layer switched: every call of every layer ran forward *and* backward on our
   kernels (a spy on the reference kernels counts them), nothing stayed on
   PyTorch, nothing failed open; T5's relative-attention bias gets its gradient
   through our kernel's ``attn_mask`` gradient, and (dropout off) it matches the
   unswitched run's as well as that one matches a float64 run.
2. Single masked calls, with the masks these models pass (rebuilt: shapes and
   dtypes as a spy on SDPA sees them under autocast, plus the models' own calls
   captured from one forward): ours (bf16) and PyTorch's SDPA (bf16), each
   against float64 SDPA on the same (upcast) inputs.
3. Dropout: ours against the explicit formula with the keep mask regenerated
   from the seed; dropped fraction, independence, seeds, unbiasedness and the
   exact scale.
4. Philox4x32-10 against Random123's known-answer vectors, and the documented
   counter layout of the dropout bits.
5. Bad ``attn_mask`` / ``dropout_p`` / ``generator`` / head dim inputs name the argument.

Error measure throughout: the max abs error of each tensor against float64.
The ``+ FLOOR`` in "ours <= 2 x PyTorch's + FLOOR": where PyTorch's BF16 result
is exact (an all-zero gradient, e.g. of a fully masked row) its error is 0 and
"<= 0" would fail on float64 noise (~1e-16); 1e-6 is 3 orders below the BF16
resolution of these O(1) values (2^-9 ~ 2e-3), so it cannot hide a real error.
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from instability_watch import InstabilityWatch, WatchConfig, flash_attention
from instability_watch.experimental import high_precision_delta
from instability_watch.kernels import common, dropout_mask, dropout_seed
from instability_watch.kernels.attention import reference
from instability_watch.kernels.common import dropout_scale, reduce_to

import family_models as fm
import real_models as rm

FLOOR = 1e-6
BF16 = torch.bfloat16
STEPS = 3

SPECS = {
    "hf-bert-padding": rm.MODELS["hf-bert-padding"],
    "hf-mistral-sliding-window": rm.MODELS["hf-mistral-sliding-window"],
    "hf-gpt2-default": rm.MODELS["hf-gpt2-default"],
    "hf-t5": fm.FAMILIES["hf-t5"],
}
# the query projection of each attention layer (one match per watched layer)
W_Q = {
    "hf-bert-padding": r"attention\.self\.query\.weight$",
    "hf-mistral-sliding-window": r"self_attn\.q_proj\.weight$",
    "hf-gpt2-default": r"attn\.c_attn\.weight$",  # fused q|k|v, Conv1D (d_in, 3 d): q is [:, :d]
    "hf-t5": r"(SelfAttention|EncDecAttention)\.q\.weight$",
}


# ----------------------------------------------------------------------------- spies


class _KernelSpy:
    """Counts the reference kernels' forward and backward calls (the CPU path of every routed call)."""

    def __init__(self, monkeypatch):
        self.forwards = 0
        self.backwards = []  # (dq max abs, dq finite, mask gradient returned)
        fwd, bwd = reference.attention_forward_lse, reference.attention_backward_lse

        def forward(*args, **kwargs):
            self.forwards += 1
            return fwd(*args, **kwargs)

        def backward(*args, **kwargs):
            dq, dk, dv, dmask = bwd(*args, **kwargs)
            self.backwards.append((float(dq.abs().max()), bool(torch.isfinite(dq).all()), dmask is not None))
            return dq, dk, dv, dmask

        # ops.py calls reference.attention_forward_lse / attention_backward_lse through the module
        monkeypatch.setattr(reference, "attention_forward_lse", forward)
        monkeypatch.setattr(reference, "attention_backward_lse", backward)


class _SDPASpy(TorchFunctionMode):
    """Records every ``F.scaled_dot_product_attention`` call's arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append((args, dict(kwargs)))
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- 1. training


def _train_switched(spec, steps=STEPS):
    """``real_models.train``'s loop, with head 0 of every layer switched before step 1."""
    torch.manual_seed(0)
    model = spec.build()
    model.train()
    watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1, shadow_every=2))
    for layer in range(len(watch.head_counts)):
        watch.switch(layer, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    losses, first = [], None
    for step in range(steps):
        batch = spec.batch(g)
        with torch.autocast("cpu", dtype=BF16):
            loss = spec.loss(model, batch)
        loss.backward()
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        watch.step(loss)
    watch.flush()
    return model, watch, losses, first


@pytest.mark.parametrize("name", list(SPECS))
def test_switched_model_trains_on_our_kernels(name, monkeypatch):
    spec = SPECS[name]
    spy = _KernelSpy(monkeypatch)
    model, watch, losses, grads = _train_switched(spec)
    try:
        layers = len(watch.head_counts)
        assert layers == spec.layers and watch.disabled == {}, watch.disabled  # nothing failed (open)
        assert all(math.isfinite(x) for x in losses), losses
        assert [e.kind for e in watch.events] == ["switch"] * layers, [e.to_dict() for e in watch.events]
        cov = watch.coverage()
        assert len(cov) == layers
        for c in cov:
            assert c.kernel_calls > 0 and c.kernel_calls == c.observed_calls, c
            assert c.not_applied == {} and c.unobserved_calls == {}, c
            # shadow steps (1, 3, ...): every call shadowed, dropout included (the kernel's own keep mask)
            assert c.shadow_skipped == {} and c.shadow_calls == c.kernel_calls // STEPS * len(range(1, STEPS + 1, 2)), c
        calls = sum(c.kernel_calls for c in cov)  # probe_every=1: every step's calls are counted
        # every routed call ran our forward and our backward, with a finite, non-zero dq
        assert spy.forwards == calls and len(spy.backwards) == calls, (spy.forwards, len(spy.backwards), calls)
        assert all(finite and dq > 0 for dq, finite, _ in spy.backwards), spy.backwards

        wq = {n: g for n, g in grads.items() if re.search(W_Q[name], n)}
        assert len(wq) == layers, sorted(wq)
        for n, g in wq.items():
            g = g[:, : g.shape[1] // 3] if name == "hf-gpt2-default" else g
            assert torch.isfinite(g).all() and g.abs().max() > 0, n

        if name == "hf-t5":
            # the relative-attention bias reaches SDPA as a float attn_mask that requires grad: in the
            # two self-attention calls of the encoder and of the decoder per step (cross-attention's
            # mask is the padding alone, no gradient)
            assert sum(m for _, _, m in spy.backwards) == 4 * STEPS
            bias = {n: g for n, g in grads.items() if "relative_attention_bias" in n}
            assert len(bias) == 2, sorted(bias)  # encoder block 0, decoder block 0
            for n, g in bias.items():
                assert torch.isfinite(g).all() and g.abs().max() > 0, n
    finally:
        watch.detach()


def _t5_without_dropout():
    """The ``hf-t5`` family model, with ``dropout_rate=0.0`` (every other setting its own)."""
    cfg = fm.hf_t5().config
    cfg.dropout_rate = 0.0  # T5Attention reads it at construction: attention dropout 0 as well
    t = fm.need("transformers")
    torch.manual_seed(0)
    return t.T5ForConditionalGeneration(cfg)


def test_t5_bias_gradient_matches_the_unswitched_run():
    """Step 1's ``relative_attention_bias`` gradient, switched vs unswitched vs a float64 run (same init,
    same batch). T5's dropout is set to 0 for this: with dropout, the switched run draws its masks
    from our Philox and the unswitched one from PyTorch's, so the two would differ by the masks."""
    spec = SPECS["hf-t5"]
    batch = spec.batch(torch.Generator().manual_seed(1))

    def bias_grads(switched: bool, float64: bool = False):
        model = _t5_without_dropout()
        model.train()
        watch = None
        if switched:
            watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=1))
            for layer in range(len(watch.head_counts)):
                watch.switch(layer, 0)
        if float64:
            loss = spec.loss(model.double(), batch)
        else:
            with torch.autocast("cpu", dtype=BF16):
                loss = spec.loss(model, batch)
        loss.backward()
        if watch is not None:
            watch.step(loss)
            watch.flush()
            assert watch.disabled == {} and all(c.kernel_calls == 1 and not c.not_applied for c in watch.coverage())
            watch.detach()
        out = {n: p.grad.double() for n, p in model.named_parameters() if "relative_attention_bias" in n}
        assert len(out) == 2
        return out

    ours, theirs, exact = bias_grads(True), bias_grads(False), bias_grads(False, float64=True)
    for n in exact:
        err_ours = (ours[n] - exact[n]).abs().max().item()
        err_theirs = (theirs[n] - exact[n]).abs().max().item()
        assert err_ours <= 2 * err_theirs + FLOOR, (n, err_ours, err_theirs)
        rel_ours = ((ours[n] - exact[n]).norm() / exact[n].norm()).item()
        rel_theirs = ((theirs[n] - exact[n]).norm() / exact[n].norm()).item()
        assert rel_ours <= 2 * rel_theirs, (n, rel_ours, rel_theirs)
        assert F.cosine_similarity(ours[n].flatten(), theirs[n].flatten(), dim=0) > 0.99, n


# ----------------------------------------------------------------------------- 2. masked calls


def _leaves(q, k, v, mask, mask_grad=True):
    ts = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    m = mask
    if mask_grad and mask is not None and mask.is_floating_point():
        m = mask.detach().clone().requires_grad_(True)
        ts.append(m)
    return ts, m


def _run(fn, q, k, v, mask, do, mask_grad=True):
    """``[o, dq, dk, dv(, dmask)]`` of ``fn(q, k, v, mask)`` with upstream gradient ``do`` (``dmask`` for a
    float mask, unless ``mask_grad=False``)."""
    ts, m = _leaves(q, k, v, mask, mask_grad)
    o = fn(ts[0], ts[1], ts[2], m)
    o.backward(do)
    return [o.detach()] + [t.grad for t in ts]


def _sdpa(scale=None, causal=False, backend=None):
    def fn(q, k, v, m):
        gqa = q.shape[1] != k.shape[1]
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, is_causal=causal, enable_gqa=gqa)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, is_causal=causal, enable_gqa=gqa)
    return fn


def _ours(scale=None, causal=False):
    return lambda q, k, v, m: flash_attention(q, k, v, attn_mask=m, scale=scale, causal=causal)


def _errors(got, exact):
    return [(g.double() - e).abs().max().item() for g, e in zip(got, exact)]


NAMES = ("o", "dq", "dk", "dv", "dmask")


def _compare(q, k, v, mask, scale=None, causal=False, seed=5):
    """Errors against float64 SDPA of ours and of PyTorch's SDPA, both bf16: ``(ours, theirs, exact, ours_out)``."""
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(BF16)
    m64 = mask.double() if mask is not None and mask.is_floating_point() else mask
    exact = _run(_sdpa(scale, causal), q.double(), k.double(), v.double(), m64, do.double())
    ours = _run(_ours(scale, causal), q, k, v, mask, do)
    theirs = _run(_sdpa(scale, causal), q, k, v, mask, do)
    for t in exact:
        assert torch.isfinite(t).all()
    return _errors(ours, exact), _errors(theirs, exact), exact, ours


def _assert_within_twice(e_ours, e_theirs, what):
    for n, a, b in zip(NAMES, e_ours, e_theirs):
        assert a <= 2 * b + FLOOR, f"{what}: {n}: ours {a:.3e} > 2 x PyTorch's BF16 {b:.3e}"


def _randn(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def _qkv(B, H, N, D, h_kv=None, n_kv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    h_kv = H if h_kv is None else h_kv
    n_kv = N if n_kv is None else n_kv
    return _randn(B, H, N, D, g=g), _randn(B, h_kv, n_kv, D, g=g), _randn(B, h_kv, n_kv, D, g=g)


def _bert_mask(B, N, pad=9, empty_row=False):
    """HF BERT's SDPA mask: bool (B, 1, N, N), True = attend; sequence 1 padded at the end."""
    m = torch.ones(B, 1, N, N, dtype=torch.bool)
    m[1, :, :, N - pad:] = False
    if empty_row:
        m[0, :, 5, :] = False  # a query that sees no key at all
    return m


def _sliding_window_mask(B, N, window=8):
    """HF Mistral's SDPA mask: bool (B, 1, N, N), causal and at most ``window`` keys back."""
    i = torch.arange(N)
    m = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    return m.expand(B, 1, N, N).contiguous()


MASKED_CASES = {
    # name: (B, H, H_kv, N, D, mask builder)
    "bert-padding": (2, 4, 4, 32, 16, lambda B, N: _bert_mask(B, N)),
    "bert-padding-empty-row": (2, 4, 4, 32, 16, lambda B, N: _bert_mask(B, N, empty_row=True)),
    "mistral-sliding-window": (2, 4, 4, 32, 16, _sliding_window_mask),
    "gqa-4-2-padding": (2, 4, 2, 32, 16, lambda B, N: _bert_mask(B, N)),
    "gqa-4-2-sliding-window": (2, 4, 2, 32, 16, _sliding_window_mask),
    "d8-padding": (2, 4, 4, 32, 8, lambda B, N: _bert_mask(B, N)),
    "d96-padding": (2, 4, 4, 32, 96, lambda B, N: _bert_mask(B, N)),
    "d256-padding": (2, 2, 2, 32, 256, lambda B, N: _bert_mask(B, N, empty_row=True)),
}


@pytest.mark.parametrize("case", list(MASKED_CASES))
def test_bool_masked_call_within_twice_pytorch_bf16(case):
    B, H, h_kv, N, D, build = MASKED_CASES[case]
    q, k, v = _qkv(B, H, N, D, h_kv=h_kv)
    mask = build(B, N)
    e_ours, e_theirs, exact, ours = _compare(q, k, v, mask)
    _assert_within_twice(e_ours, e_theirs, case)
    empty = ~mask.expand(B, H, N, N).any(dim=-1)  # (B, H, N): rows that see no key
    if empty.any():  # as CPU SDPA (and float64 SDPA): output 0 and no gradient from such a row
        assert (ours[0][empty] == 0).all() and (ours[1][empty] == 0).all()
        assert (exact[0][empty] == 0).all() and (exact[1][empty] == 0).all()


def _t5_mask(B, H, N, n_kv, g, broadcast_batch: bool, causal: bool):
    """T5's SDPA mask under autocast: position bias (float, requires grad) + padding (float32 min,
    which autocast's cast to bf16 turns into -inf); (B, H, N, N_kv), or (1, H, N, N) for the decoder's
    self-attention (its bias is shared by the batch, so its gradient is summed over it)."""
    bias = torch.randn(1, H, N, n_kv, generator=g) * 2
    if causal:
        i = torch.arange(N)
        bias = bias.masked_fill(i[None, :] > i[:, None], torch.finfo(torch.float32).min)
    if broadcast_batch:
        return bias.to(BF16)
    pad = torch.zeros(B, 1, 1, n_kv)
    pad[1, ..., n_kv - 5:] = torch.finfo(torch.float32).min
    return (bias + pad).to(BF16)


def _check_float_bias_call(q, k, v, mask, do, scale, what):
    """A call with a float mask that requires grad (T5's), all in bf16, against float64 SDPA.

    PyTorch's CPU SDPA sends a mask that requires grad to its MATH backend, which computes bf16 inputs
    in float32 and rounds only the results: not a BF16 attention kernel. PyTorch's own BF16 kernel
    (CPU flash attention, FA2's precision model, what it runs for every other call here) takes the
    same mask without its gradient: that is the comparison for o, dq, dk, dv. For the mask's gradient
    only the math backend answers; ours is held to 2x its error plus the one term FA2's design adds
    and the math backend lacks: ``delta = rowsum(dO * O)`` from the rounded BF16 ``O`` (attention/reference.py's
    backward; "delta_lp"), i.e. ``|P (delta_lp - delta)|`` summed over the mask's broadcast dims. With
    ``high_precision_delta()`` (delta from a float32 ``O``) that term is gone, and the plain 2x must hold.
    """
    exact = _run(_sdpa(scale), q.double(), k.double(), v.double(), mask.double(), do.double())
    ours = _run(_ours(scale), q, k, v, mask, do)
    with high_precision_delta():
        ours_hp = _run(_ours(scale), q, k, v, mask, do)
    math_bf16 = _run(_sdpa(scale), q, k, v, mask, do)  # what PyTorch dispatches: MATH
    flash_bf16 = _run(_sdpa(scale, backend=SDPBackend.FLASH_ATTENTION), q, k, v, mask, do, mask_grad=False)
    e_ours, e_math, e_flash = _errors(ours, exact), _errors(math_bf16, exact), _errors(flash_bf16, exact)
    _assert_within_twice(e_ours[:4], e_flash, f"{what} vs PyTorch's BF16 flash kernel")

    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    s = (q.double() @ _expand(k, group).double().transpose(-1, -2)) * sc + mask.double()
    p = torch.softmax(s, dim=-1)
    delta_lp = (do.double() * ours[0].double()).sum(-1, keepdim=True)
    delta = (do.double() * exact[0]).sum(-1, keepdim=True)
    fa2_term = reduce_to((p * (delta_lp - delta)).abs(), mask.shape).max().item()
    assert e_ours[4] <= 2 * e_math[4] + fa2_term + FLOOR, (what, e_ours[4], e_math[4], fa2_term)
    e_hp = _errors(ours_hp, exact)[4]
    assert e_hp <= 2 * e_math[4] + FLOOR, (what, e_hp, e_math[4])
    assert ours[4].shape == mask.shape and ours[4].dtype == mask.dtype
    return e_ours, e_math, e_flash, fa2_term


@pytest.mark.parametrize("shape", ["encoder-B-H-N-N", "decoder-1-H-N-N-causal"])
def test_t5_float_bias_call_within_twice_pytorch_bf16(shape):
    """T5's float mask that requires grad (D = d_kv = 8, scale 1); see ``_check_float_bias_call``."""
    B, H, N, D = 2, 4, 16, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (_randn(B, H, N, D, g=g) for _ in range(3))
    mask = _t5_mask(B, H, N, N, g, broadcast_batch=shape.startswith("decoder"), causal=shape.endswith("causal"))
    do = _randn(B, H, N, D, g=g)
    _check_float_bias_call(q, k, v, mask, do, 1.0, f"T5 {shape}")


@pytest.mark.parametrize("name", list(SPECS))
def test_the_models_own_calls_within_twice_pytorch_bf16(name):
    """Every SDPA call of one training forward of the model (under autocast), replayed in bf16 (as
    autocast casts it, masks included) without dropout, with a random upstream gradient: against SDPA
    as dispatched, and T5's masks that require grad as in ``_check_float_bias_call``."""
    spec = SPECS[name]
    torch.manual_seed(0)
    model = spec.build()
    model.train()
    with _SDPASpy() as spy, torch.autocast("cpu", dtype=BF16):
        spec.loss(model, spec.batch(torch.Generator().manual_seed(1)))
    assert len(spy.calls) == spec.layers
    kinds = set()
    for i, (args, kw) in enumerate(spy.calls):
        assert len(args) == 3 and set(kw) <= {"attn_mask", "dropout_p", "is_causal", "scale"}, (len(args), kw)
        q, k, v = (t.detach().to(BF16) for t in args)
        mask = kw.get("attn_mask")
        scale, causal = kw.get("scale"), bool(kw.get("is_causal", False))
        do = torch.randn(q.shape, generator=torch.Generator().manual_seed(i)).to(BF16)
        if mask is not None and mask.requires_grad:
            kinds.add("float-with-grad")
            _check_float_bias_call(q, k, v, mask.detach().to(BF16), do, scale, f"{name} call {i}")
            continue
        if mask is not None and mask.is_floating_point():
            mask = mask.detach().to(BF16)
        kinds.add("none" if mask is None else str(mask.dtype))
        m64 = mask.double() if mask is not None and mask.is_floating_point() else mask
        exact = _run(_sdpa(scale, causal), q.double(), k.double(), v.double(), m64, do.double(), mask_grad=False)
        ours = _run(_ours(scale, causal), q, k, v, mask, do, mask_grad=False)
        theirs = _run(_sdpa(scale, causal), q, k, v, mask, do, mask_grad=False)
        _assert_within_twice(_errors(ours, exact), _errors(theirs, exact), f"{name} call {i}")
    expect = {"hf-bert-padding": {"torch.bool"}, "hf-mistral-sliding-window": {"torch.bool"},
              "hf-gpt2-default": {"none"}, "hf-t5": {"float-with-grad", "torch.bfloat16"}}[name]
    assert kinds == expect, kinds


# ----------------------------------------------------------------------------- 3. dropout


def _expand(t, group):
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _formula(q, k, v, keep, inv, *, scale, causal, mask, bf16: bool):
    """``(softmax(S) * keep * inv) @ V``, S = scale Q K^T (+ mask, causal), by PyTorch ops.

    ``bf16=False``: everything in float64 (the reference). ``bf16=True``: PyTorch's BF16 version of the
    same formula: S from the bf16 Q, K accumulated in float32 (as every BF16 attention kernel, ours and
    PyTorch's, computes it), the softmax in float32, ``P * keep * inv`` cast to bf16, ``@ V`` a bf16
    matmul, output bf16; its backward is autograd's through those ops (dP a bf16 matmul, the softmax's
    backward in float32 with its own exact ``sum(P * dP)``). PyTorch's SDPA cannot take a given dropout
    mask, so this stands for its BF16 error.
    """
    group = q.shape[1] // k.shape[1]
    cdt = torch.float32 if bf16 else torch.float64
    kk, vv = _expand(k, group), _expand(v, group)
    s = (q.to(cdt) @ kk.to(cdt).transpose(-1, -2)) * scale
    N, n_kv = q.shape[2], k.shape[2]
    if causal:
        s = s.masked_fill(torch.ones(N, n_kv, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s + (mask.to(cdt) if mask.is_floating_point()
                 else torch.zeros(mask.shape, dtype=cdt).masked_fill(~mask, float("-inf")))
    p = torch.softmax(s, dim=-1) * keep * inv
    if bf16:
        return p.to(BF16) @ vv
    return p @ vv.to(torch.float64)


def _dropout_case(causal, gqa, mask_kind, B=2, H=4, N=32, D=16, p=0.2, seed=11):
    g = torch.Generator().manual_seed(100 + seed)
    h_kv = 2 if gqa else H
    q, k, v = (_randn(B, hh, N, D, g=g) for hh in (H, h_kv, h_kv))
    do = _randn(B, H, N, D, g=g)
    mask = None
    if mask_kind == "bool":
        mask = _bert_mask(B, N)
    elif mask_kind == "float":  # T5's bias (B, H, N, N), requires grad
        mask = _t5_mask(B, H, N, N, g, broadcast_batch=False, causal=False)
    return q, k, v, do, mask, p, seed


DROPOUT_CASES = {
    "noncausal": (False, False, None),
    "causal": (True, False, None),
    "noncausal-gqa-padding": (False, True, "bool"),
    "causal-gqa": (True, True, None),
    "bias-with-grad": (False, False, "float"),
}


@pytest.mark.parametrize("case", list(DROPOUT_CASES))
def test_dropout_call_against_the_same_mask(case):
    causal, gqa, mask_kind = DROPOUT_CASES[case]
    q, k, v, do, mask, p, seed = _dropout_case(causal, gqa, mask_kind)
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D)
    keep = dropout_mask(dropout_seed(torch.Generator().manual_seed(seed), "cpu"), B, H, N, N, p)
    inv = dropout_scale(p)
    assert keep.shape == (B, H, N, N) and keep.dtype == torch.bool

    def ours(q_, k_, v_, m_):
        return flash_attention(q_, k_, v_, attn_mask=m_, dropout_p=p, causal=causal,
                               generator=torch.Generator().manual_seed(seed))

    def formula(bf16):
        return lambda q_, k_, v_, m_: _formula(q_, k_, v_, keep, inv, scale=scale, causal=causal, mask=m_, bf16=bf16)

    m64 = mask.double() if mask is not None and mask.is_floating_point() else mask
    exact = _run(formula(False), q.double(), k.double(), v.double(), m64, do.double())
    got = _run(ours, q, k, v, mask, do)
    theirs = _run(formula(True), q, k, v, mask, do)
    _assert_within_twice(_errors(got, exact), _errors(theirs, exact), f"dropout {case}")

    # float64 inputs: no rounding anywhere, so ours is the formula to float64 accuracy: the same
    # kept entries, the same scale, forward and backward (mask gradient included)
    got64 = _run(ours, q.double(), k.double(), v.double(), m64, do.double())
    for n, a, b in zip(NAMES, got64, exact):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{case} {n} float64: {m}")


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropped_fraction_and_independence(p):
    B, H, N, K = 4, 8, 256, 256
    seed = dropout_seed(torch.Generator().manual_seed(7), "cpu")
    keep = dropout_mask(seed, B, H, N, K, p)
    p_eff = common.dropout_threshold(p) / 65536
    assert abs(p_eff - p) <= 2 ** -17
    dropped = ~keep

    def within(frac, expect, n, what):
        se = math.sqrt(expect * (1 - expect) / n)
        assert abs(frac - expect) <= 5 * se, f"{what}: {frac:.5f} vs {expect:.5f} (5 SE = {5 * se:.5f})"

    within(dropped.double().mean().item(), p_eff, dropped.numel(), "dropped fraction")
    per_head = dropped.double().mean(dim=(2, 3)).flatten()  # every (b, h) has its own counters
    for i, f in enumerate(per_head.tolist()):
        within(f, p_eff, N * K, f"(b, h) #{i}")
    for i, f in enumerate(dropped.double().mean(dim=(0, 1, 3)).tolist()):  # per query row
        within(f, p_eff, B * H * K, f"row {i}")
    for j, f in enumerate(dropped.double().mean(dim=(0, 1, 2)).tolist()):  # per key column
        within(f, p_eff, B * H * N, f"column {j}")
    # pairs sharing a 32-bit Philox word (j, j+1 for even j), pairs from the same call's other words
    # (j, j+8), and pairs of different calls (j+1, j+2: the next call; j, j+32: the next group) are
    # dropped together as often as independent entries
    for gap, start in ((1, 0), (8, 0), (1, 1), (32, 0), (2, 0)):
        a, b = dropped[..., start::64], dropped[..., start + gap::64]
        n = min(a.shape[-1], b.shape[-1])
        within((a[..., :n] & b[..., :n]).double().mean().item(), p_eff ** 2, a[..., :n].numel(), f"pairs gap {gap}")

    other = dropout_mask(dropout_seed(torch.Generator().manual_seed(8), "cpu"), B, H, N, K, p)
    within((other != keep).double().mean().item(), 2 * p_eff * (1 - p_eff), keep.numel(), "two seeds differ")
    assert torch.equal(dropout_mask(seed.clone(), B, H, N, K, p), keep)


def test_seeds_reproduce_and_differ():
    q, k, v, do, mask, p, _ = _dropout_case(False, True, "bool")

    def call(gen=None):
        return _run(lambda q_, k_, v_, m_: flash_attention(q_, k_, v_, attn_mask=m_, dropout_p=p, generator=gen),
                    q, k, v, mask, do)

    a = call(torch.Generator().manual_seed(1))
    b = call(torch.Generator().manual_seed(1))
    c = call(torch.Generator().manual_seed(2))
    for n, x, y, z in zip(NAMES, a, b, c):
        assert torch.equal(x, y), f"{n}: same seed, different result"
        assert not torch.equal(x, z), f"{n}: different seeds, same result"
    # no generator: the default CPU generator, as SDPA (this is how a switched model's calls draw)
    torch.manual_seed(123)
    d = call()
    torch.manual_seed(123)
    e = call()
    for n, x, y in zip(NAMES, d, e):
        assert torch.equal(x, y), n
    # ... and the seed it used is the default generator's next draw: float64 (no rounding) against the
    # formula with that seed's mask
    q64, k64, v64 = q.double(), k.double(), v.double()
    torch.manual_seed(321)
    o = flash_attention(q64, k64, v64, attn_mask=mask, dropout_p=p)
    torch.manual_seed(321)
    keep = dropout_mask(dropout_seed(None, "cpu"), *q.shape[:3], k.shape[2], p)
    exact = _formula(q64, k64, v64, keep, dropout_scale(p), scale=1 / math.sqrt(q.shape[-1]),
                     causal=False, mask=mask, bf16=False)
    torch.testing.assert_close(o, exact, rtol=1e-10, atol=1e-12)


def test_dropout_is_unbiased_with_the_derived_variance():
    """Mean over seeds of the float64 dropout output -> the output without dropout.

    One entry ``o = sum_j P_j v_j z_j / (1 - p)`` with ``z_j ~ Bernoulli(1 - p)`` independent has mean
    ``sum_j P_j v_j`` and variance ``p / (1 - p) * sum_j (P_j v_j)^2``; over ``S`` seeds the mean's
    variance is that over ``S``. The z-scores of the seed means must look standard normal (RMS ~ 1,
    none beyond 6), at 16 and 64 seeds, and the error itself must shrink ~ 1/sqrt(S).
    """
    B, H, N, D, p = 2, 4, 64, 4, 0.3
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    o0 = flash_attention(q, k, v)
    P = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(D), dim=-1)
    p_eff = common.dropout_threshold(p) / 65536
    var = p_eff / (1 - p_eff) * ((P[..., None] * v[:, :, None]) ** 2).sum(dim=-2)  # (B, H, N, D)
    outs = torch.stack([flash_attention(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(s))
                        for s in range(64)])
    rms = {}
    for S in (16, 64):
        err = outs[:S].mean(0) - o0
        z = err / (var / S).sqrt()
        assert z.abs().max() < 6, (S, z.abs().max())
        zr = z.pow(2).mean().sqrt().item()
        assert 0.8 < zr < 1.2, (S, zr)
        rms[S] = err.pow(2).mean().sqrt().item()
    assert 0.35 < rms[64] / rms[16] < 0.7, rms  # 1/sqrt(4) = 0.5


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_kept_entries_scaled_by_exactly_one_over_one_minus_p_eff(p):
    """V = identity (N_kv = D): then ``o = softmax(S) * keep * scale`` entry by entry (float64)."""
    B, H, N, n = 2, 2, 16, 64
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, H, N, n, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, n, n, generator=g, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).expand(B, H, n, n)
    o = flash_attention(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(5))
    keep = dropout_mask(dropout_seed(torch.Generator().manual_seed(5), "cpu"), B, H, N, n, p)
    P = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(n), dim=-1)
    assert (o[~keep] == 0).all()
    ratio = o[keep] / P[keep]
    p_eff = common.dropout_threshold(p) / 65536
    expect = 1 / (1 - p_eff)
    assert p_eff != p and abs(expect - 1 / (1 - p)) > 1e-6  # the two scales are told apart below
    torch.testing.assert_close(ratio, torch.full_like(ratio, expect), rtol=1e-12, atol=0)
    assert dropout_scale(p) == pytest.approx(expect, rel=1e-15)


# ----------------------------------------------------------------------------- 4. Philox


@pytest.mark.parametrize(
    "counter, key, expect",
    [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ],
)
def test_philox_known_answers(counter, key, expect):
    """Random123's kat_vectors for philox4x32_10."""
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    out = common.philox(t(key[0]), t(key[1]), *(t(c) for c in counter))
    assert tuple(int(w) for w in out) == expect, [hex(int(w)) for w in out]
    # broadcast over counters: the same words at every position of a tensor counter
    out = common.philox(t(key[0]), t(key[1]), *(torch.full((3,), c, dtype=torch.int64) for c in counter))
    assert all(w.tolist() == [e] * 3 for w, e in zip(out, expect))


def test_dropout_bits_follow_the_documented_counter_layout():
    """Entry (b, h, i, j): Philox of counter (4 (j // 32) + (j % 8) // 2, i, b * H + h, 0), word (j % 32) // 8,
    low 16 bits for even j, high for odd j; kept where the bits are >= round(p * 2^16)."""
    seed = torch.tensor([0x12345678, 0x9ABCDEF0], dtype=torch.int64)
    B, H, N, K, p = 2, 3, 5, 71, 0.37
    keep = dropout_mask(seed, B, H, N, K, p)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    for b in range(B):
        for h in range(H):
            for i in range(N):
                for j in range(K):
                    words = common.philox(t(0x12345678), t(0x9ABCDEF0), t(4 * (j // 32) + (j % 8) // 2), t(i),
                                             t(b * H + h), t(0))
                    bits = (int(words[(j % 32) // 8]) >> (16 * (j % 2))) & 0xFFFF
                    assert bool(keep[b, h, i, j]) == (bits >= round(p * 65536)), (b, h, i, j)
    # every call's eight entries lie in one row, each entry drawn by exactly one call
    cols = torch.arange(128)
    counter = common.dropout_counter(cols)
    assert torch.equal(torch.bincount(counter), torch.full((16,), 8))


# ----------------------------------------------------------------------------- 5. bad inputs


def _small():
    return _qkv(2, 2, 8, 16)


@pytest.mark.parametrize(
    "mask, exc, pattern",
    [
        (lambda: torch.ones(2, 1, 8, 9, dtype=torch.bool), ValueError, r"attn_mask must broadcast to .*\(2, 1, 8, 9\)"),
        (lambda: torch.ones(3, 2, 8, 8, dtype=torch.bool), ValueError, r"attn_mask must broadcast"),
        (lambda: torch.ones(1, 1, 1, 2, 8, 8, dtype=torch.bool), ValueError, r"attn_mask must broadcast"),
        (lambda: torch.ones(2, 1, 8, 8, dtype=torch.int64), TypeError, r"attn_mask must be boolean .*torch.int64"),
        (lambda: torch.ones(2, 1, 8, 8, dtype=torch.bool, device="meta"), ValueError,
         r"attn_mask must be on q's device"),
        (lambda: [[True]], TypeError, r"attn_mask must be None or a torch.Tensor"),
    ],
)
def test_bad_attn_mask(mask, exc, pattern):
    q, k, v = _small()
    with pytest.raises(exc, match=pattern):
        flash_attention(q, k, v, attn_mask=mask())


def test_attn_mask_with_causal_names_both():
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"attn_mask and causal=True"):
        flash_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool), causal=True)


@pytest.mark.parametrize("p", [1.0, -0.1, True, float("nan"), "0.1", 1])
def test_bad_dropout_p(p):
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\), got " + re.escape(repr(p))):
        flash_attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("gen", [42, "cpu", torch.device("cpu")])
def test_bad_generator(gen):
    q, k, v = _small()
    with pytest.raises(TypeError, match=r"generator must be None or a torch.Generator, got"):
        flash_attention(q, k, v, dropout_p=0.1, generator=gen)


@pytest.mark.parametrize("seed, exc, pattern", [
    (7, TypeError, r"seed must be None or an int64 tensor of shape \(2,\) .*got int"),
    (torch.zeros(2, dtype=torch.int32), TypeError, r"seed must be .*got torch.int32 \(2,\)"),
    (torch.zeros(3, dtype=torch.int64), TypeError, r"seed must be .*got torch.int64 \(3,\)"),
])
def test_bad_seed(seed, exc, pattern):
    q, k, v = _small()
    with pytest.raises(exc, match=pattern):
        flash_attention(q, k, v, dropout_p=0.1, seed=seed)


def test_seed_or_generator_not_both_and_a_given_seed_fixes_the_mask():
    q, k, v = _small()
    seed = dropout_seed(torch.Generator().manual_seed(3), "cpu")
    with pytest.raises(ValueError, match="seed and generator cannot both be given"):
        flash_attention(q, k, v, dropout_p=0.1, seed=seed, generator=torch.Generator())
    a = flash_attention(q, k, v, dropout_p=0.3, seed=seed)
    b = flash_attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(3))  # draws the same seed
    c = flash_attention(q, k, v, dropout_p=0.3, seed=seed + 1)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_head_dim_257_is_refused():
    q, k, v = _qkv(1, 1, 4, 257)
    with pytest.raises(ValueError, match=r"head dim D .* must be in \[1, 256\], got 257"):
        flash_attention(q, k, v)
