"""flash_attention's argument checks: every bad input names the argument, the allowed set and the value."""
import pytest
import torch

from instability_watch import Probe, flash_attention


def _qkv(B=1, H=4, N=8, D=32, h_kv=None, dtype=torch.bfloat16):
    h_kv = H if h_kv is None else h_kv
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, H, N, D, generator=g).to(dtype),
        torch.randn(B, h_kv, N, D, generator=g).to(dtype),
        torch.randn(B, h_kv, N, D, generator=g).to(dtype),
    )


@pytest.mark.parametrize(
    "make, exc, pattern",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"q must be 4-D \(B, H, N, D\), got shape \(4, 8, 32\)"),
        (lambda q, k, v: (q, k[..., None], v), ValueError, r"k must be 4-D .* got shape \(1, 4, 8, 32, 1\)"),
        (lambda q, k, v: ("q", k, v), TypeError, r"q must be a torch.Tensor .* got str"),
        (lambda q, k, v: (q, k.float(), v), TypeError, r"k must have q's dtype torch.bfloat16, got torch.float32"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, r"dtype must be one of .*bfloat16.*; got torch.int32"),
        (lambda q, k, v: tuple(torch.cat([t] * 9, dim=-1)[..., :257] for t in (q, k, v)), ValueError,
         r"head dim D .* must be in \[1, 256\], got 257"),
        (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, r"k and v must have the same shape"),
        (lambda q, k, v: (q, k[:, :3], v[:, :3]), ValueError, r"divisible by k/v heads H_kv .* got H=4, H_kv=3"),
        (lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), ValueError, r"k batch size must equal q's \(1\), got 2"),
        (lambda q, k, v: (q[:, :, :0], k, v), ValueError, r"sequence lengths must be >= 1, got N=0"),
    ],
)
def test_bad_tensors(make, exc, pattern):
    q, k, v = make(*_qkv())
    with pytest.raises(exc, match=pattern):
        flash_attention(q, k, v)


def test_mismatched_devices():
    q, k, v = _qkv()
    k = k.to("meta")
    with pytest.raises(ValueError, match=r"k must be on q's device cpu, got meta"):
        flash_attention(q, k, v)


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(stabilize=torch.ones(3, dtype=torch.bool)), ValueError, r"stabilize must have shape \(4,\) .* got \(3,\)"),
        (dict(stabilize=torch.ones(4)), TypeError, r"stabilize must be a bool tensor of shape \(4,\), got dtype torch.float32"),
        (dict(stabilize=[True] * 4), TypeError, r"stabilize must be None, a bool, or a bool tensor .* got list"),
        (dict(stabilize=torch.ones(4, dtype=torch.bool, device="meta")), ValueError, r"stabilize must be on q's device cpu, got meta"),
        (dict(causal=1), TypeError, r"causal must be a bool, got 1"),
        (dict(scale=float("nan")), ValueError, r"scale must be None or a number in \(0, 3.403e\+38\] .*got nan"),
        (dict(scale=-0.1), ValueError, r"scale must be None or a number in \(0, 3.403e\+38\] .*got -0.1"),
        (dict(scale="0.1"), ValueError, r"scale must be None or a number in \(0, 3.403e\+38\] .*got '0.1'"),
        (dict(beta=1.0), ValueError, r"beta must be a number in \(1, 1024\] .* got 1.0"),
        (dict(eps=-1e-3), ValueError, r"eps must be a number in \[0, 3.403e\+38\] .*got -0.001"),
        (dict(probe=object()), TypeError, r"probe must be None or an instability_watch.Probe, got object"),
        (dict(probe=Probe(3)), ValueError, r"probe has 3 heads, q has H=4"),
        (dict(backend="cuda"), ValueError, r"backend must be one of \('auto', 'triton', 'reference'\), got 'cuda'"),
    ],
)
def test_bad_options(kwargs, exc, pattern):
    q, k, v = _qkv()
    with pytest.raises(exc, match=pattern):
        flash_attention(q, k, v, **kwargs)


def test_stabilize_forms_agree():
    q, k, v = _qkv(N=40)
    q = q[:, :, :1] + 0.1 * q  # all rows close to one direction u = q[:, :, 0]
    k[:, :, 7] = k[:, :, 30] = 2 * q[:, :, 0]  # two identical keys along u: every row's maximum repeats
    probe = Probe(4)
    all_true = flash_attention(q, k, v, stabilize=True, probe=probe)
    assert probe.multi_max_rows.tolist() == [40, 40, 40, 40]
    as_mask = flash_attention(q, k, v, stabilize=torch.ones(4, dtype=torch.bool))
    assert torch.equal(all_true, as_mask)
    standard = flash_attention(q, k, v)
    assert not torch.equal(all_true, standard)  # the shift did change the rounding
    assert torch.equal(flash_attention(q, k, v, stabilize=False), standard)
    one_head = flash_attention(q, k, v, stabilize=torch.tensor([False, True, False, False]))
    assert torch.equal(one_head[:, 1], all_true[:, 1]) and torch.equal(one_head[:, 0], standard[:, 0])


def test_gqa_and_noncontiguous_inputs():
    q, k, v = _qkv(B=2, H=8, N=33, D=64, h_kv=2)
    # (B, N, H, D) storage viewed as (B, H, N, D), as attention modules produce it
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    assert torch.equal(flash_attention(qt, k, v, causal=True), flash_attention(q, k, v, causal=True))


def test_outputs_and_grads_keep_the_inputs_layout():
    # q, k, v as nanoGPT makes them: transposed views of a (B, N, 3, H, D) projection
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 17, 3 * 4 * 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    q, k, v = (t.view(2, 17, 4, 16).transpose(1, 2) for t in qkv.split(64, dim=2))
    o = flash_attention(q, k, v, causal=True)
    assert o.stride() == q.new_empty(2, 17, 4, 16).transpose(1, 2).stride()
    ref = flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(o, ref)
    assert o.transpose(1, 2).is_contiguous()  # the model's transpose back is free
    o.float().square().sum().backward()
    grad = qkv.grad.clone()
    qkv.grad = None
    q2, k2, v2 = (t.view(2, 17, 4, 16).transpose(1, 2).contiguous() for t in qkv.split(64, dim=2))
    flash_attention(q2, k2, v2, causal=True).float().square().sum().backward()
    assert torch.equal(grad, qkv.grad)
