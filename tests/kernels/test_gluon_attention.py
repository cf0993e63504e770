"""The Gluon kernels (D = 256, sm_90: forward, dQ, dK/dV): which calls they take, their TMA views, that they compile.

It runs only on a Hopper GPU (tests/kernels/test_triton_gpu.py checks its gradients there); here, on any
machine: the 2-D views its tiles are read through, the calls it refuses, the backward's fallback
under Triton's interpreter, and a compile for sm_90 with Triton's bundled ptxas (no GPU needed).
"""
import importlib.util

import pytest
import torch

from instability_watch.kernels.attention import gluon as ga


def _layouts(B=2, H=3, N=128, D=256, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, N, 3 * H * D, generator=g).to(dtype)
    return {
        "bhnd": torch.randn(B, H, N, D, generator=g).to(dtype),
        "bnhd": torch.randn(B, N, H, D, generator=g).to(dtype).transpose(1, 2),
        "qkv_slice_k": x[..., H * D:2 * H * D].view(B, N, H, D).transpose(1, 2),  # GPT-2's c_attn split
        "one_head": torch.randn(B, 1, N, D, generator=g).to(dtype),
        "every_other_token": torch.randn(B, H, 2 * N, D, generator=g).to(dtype)[:, :, ::2],
    }


@pytest.mark.parametrize("name", ["bhnd", "bnhd", "qkv_slice_k", "one_head", "every_other_token"])
def test_tma_view_addresses_every_element(name):
    t = _layouts()[name]
    got = ga.tma_view(t)
    assert got is not None
    view, rb, rh, ch = got
    B, H, N, D = t.shape
    b, h, n = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(N), indexing="ij")
    rows = (b * rb + h * rh + n)[..., None]
    cols = (h * ch)[..., None] + torch.arange(D)
    assert torch.equal(view[rows, cols], t)
    assert view.data_ptr() == t.data_ptr() and view.stride(1) == 1


def test_tma_view_refuses_layouts_it_cannot_tile():
    t = _layouts()["bhnd"]
    assert ga.tma_view(t.transpose(2, 3)) is None  # head dim not the unit-stride one
    gap = torch.zeros(2 * 3 * (128 * 256 + 256), dtype=torch.bfloat16)  # 256 unused elements between heads
    assert ga.tma_view(gap.as_strided((2, 3, 128, 256), (3 * (128 * 256 + 256), 128 * 256 + 256, 256, 1))) is None
    wide = torch.zeros(2, 64, 3, 304, dtype=torch.bfloat16)[..., :256].transpose(1, 2)  # heads 304 apart
    assert ga.tma_view(wide) is None
    unaligned_base = torch.zeros(2, 3, 128, 260, dtype=torch.bfloat16)[..., 4:]  # 8 bytes past a 16-byte boundary
    assert ga.tma_view(unaligned_base.contiguous()) is not None and ga.tma_view(unaligned_base) is None
    odd_rows = torch.zeros(2, 3, 128, 260, dtype=torch.bfloat16)[..., :256]  # rows 520 bytes apart
    assert ga.tma_view(odd_rows) is None
    assert ga.tma_view(torch.zeros(2, 3, 128, 264, dtype=torch.bfloat16)[..., :256]) is not None  # 528 bytes


def test_supported_names_why_not(monkeypatch):
    monkeypatch.setattr(ga, "_failed", None)
    q = torch.zeros(1, 2, 128, 256, dtype=torch.bfloat16)
    assert ga.supported(q, q, q, q, masked=True, dropout=False) == "mask or dropout"
    assert ga.supported(q, q, q, q, masked=False, dropout=True) == "mask or dropout"
    assert ga.supported(q, q, q, q, masked=False, dropout=False) == "not an sm_90 GPU"


def test_supported_names_the_block_the_forward_needs(monkeypatch):
    monkeypatch.setattr(ga, "_failed", None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    q = torch.zeros(1, 2, 192, 256, dtype=torch.bfloat16)
    assert ga.supported(q, q, q, q, masked=False, dropout=False) is None  # dK/dV: 64 keys a program
    assert ga.supported(q, q, q, q, masked=False, dropout=False, block=128) == (
        "GQA, cross-attention or N not a multiple of 128")
    assert ga.supported(q[..., :128], q, q, q, masked=False, dropout=False) == "head dim or dtype"


def test_forward_with_gluon_true_raises_where_it_cannot_serve():
    from instability_watch.kernels.attention.triton import attention_forward_lse2
    from instability_watch.kernels.launch import INTERPRET

    if not INTERPRET:
        pytest.skip("the interpreter's case")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 16, 256, generator=g).to(torch.bfloat16) for _ in range(3))
    kw = dict(causal=True, scale=256 ** -0.5, beta=1.0, eps=0.0, counts=None, values=None)
    with pytest.raises(ValueError, match="gluon=True.*interpreter"):
        attention_forward_lse2(q, k, v, stabilize=None, gluon=True, **kw)
    with pytest.raises(ValueError, match="gluon=True.*interpreter"):  # stabilized heads: served where it can
        attention_forward_lse2(q, k, v, stabilize=torch.ones(1, dtype=torch.bool), gluon=True, **kw)
    from instability_watch.probe.bank import Probe

    probe = Probe(1)
    with pytest.raises(ValueError, match="gluon=True.*a probe, mask or dropout"):
        attention_forward_lse2(q, k, v, stabilize=None, gluon=True, **{**kw, "counts": probe.counts,
                                                                        "values": probe.values})
    auto = attention_forward_lse2(q, k, v, stabilize=None, **kw)  # the Triton kernel serves
    off = attention_forward_lse2(q, k, v, stabilize=None, gluon=False, **kw)
    for a, b in zip(auto, off):
        assert torch.equal(a, b)


def test_a_strided_stabilize_mask_picks_the_same_heads():
    """The kernels read one byte per head: a strided (B, H) mask view stabilizes the heads it says."""
    from instability_watch.kernels.attention.triton import attention_forward_lse2
    from instability_watch.kernels.launch import INTERPRET

    if not INTERPRET:
        pytest.skip("the interpreter's case")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    k[:, :, 1::2] = k[:, :, 0::2]  # ties: the stabilized head's shift moves
    kw = dict(causal=False, scale=0.25, beta=2.0, eps=1e-3, counts=None, values=None)
    strided = torch.tensor([[True, True], [False, False]])[:, 0]  # [True, False], stride 2 (memory: T T F F)
    assert strided.stride() == (2,)
    o_s, lse_s = attention_forward_lse2(q, k, v, stabilize=strided, **kw)
    o_c, lse_c = attention_forward_lse2(q, k, v, stabilize=strided.contiguous(), **kw)
    o_p, lse_p = attention_forward_lse2(q, k, v, stabilize=None, **kw)
    assert torch.equal(o_s, o_c) and torch.equal(lse_s, lse_c)
    assert torch.equal(o_s[:, 1], o_p[:, 1]) and torch.equal(lse_s[:, 1], lse_p[:, 1])  # head 1: not stabilized
    assert not torch.equal(lse_s[:, 0], lse_p[:, 0])  # head 0 is (its ties moved the shift)


def test_backward_with_gluon_true_raises_where_it_cannot_serve():
    from instability_watch.kernels.attention.triton import attention_backward_lse2, attention_forward_lse2
    from instability_watch.kernels.launch import INTERPRET

    if not INTERPRET:
        pytest.skip("the interpreter's case")
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, 1, 16, 256, generator=g).to(torch.bfloat16) for _ in range(4))
    kw = dict(causal=True, scale=256 ** -0.5, counts=None, values=None)
    o, lse2 = attention_forward_lse2(q, k, v, stabilize=None, beta=1.0, eps=0.0, **kw)
    with pytest.raises(ValueError, match="gluon=True.*interpreter"):
        attention_backward_lse2(q, k, v, o, lse2, do, shadow=False, gluon=True, **kw)
    auto = attention_backward_lse2(q, k, v, o, lse2, do, shadow=False, **kw)  # falls back to Triton's kernels
    off = attention_backward_lse2(q, k, v, o, lse2, do, shadow=False, gluon=False, **kw)
    for a, b in zip(auto[:3], off[:3]):
        assert torch.equal(a, b)


def _have_gluon_hopper():
    return all(importlib.util.find_spec(m) is not None for m in (
        "triton.experimental.gluon", "triton.experimental.gluon.language.nvidia.hopper"))


_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from instability_watch.kernels.attention import gluon_kernels as gk

tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def desc(rows):
    return f"tensordesc<bf16[{rows}, 256],{gl.NVMMASharedLayout.get_default_for([rows, 256], gl.bfloat16)!r}>"


def geometry(*names):
    return {f"{n}_{x}": "i32" for n in names for x in ("rb", "rh", "ch")}


def compile_one(fn, sig, const):
    sig = {**sig, **{name: "constexpr" for name in const}}
    compiled = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=8))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    stack = re.search(r"STACK:(\d+)", usage)
    return dict(wgmma="wgmma.mma_async" in compiled.asm["ptx"], stack=int(stack.group(1)) if stack else None,
                shared=compiled.metadata.shared, usage=usage[-300:])


out = {}
sig = {n: desc(64) for n in ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc")}
sig.update(LSE2="*fp32", Delta="*fp32", **geometry("q", "k", "v", "do", "dk", "dv"))
sig.update(H="i32", N="i32", qk_scale="fp32", scale="fp32")
out["dkdv"] = compile_one(gk.build_dkdv_kernel(), sig, dict(CAUSAL=True, HEAD_DIM=256, BLOCK_M=64, BLOCK_N=64, num_warps=8))
for causal in (True, False):
    for stab in (False, True):
        sig = dict(q_desc=desc(128), k_desc=desc(64), v_desc=desc(64), o_desc=desc(128), LSE2="*fp32", Stab="*u8",
                   **geometry("q", "k", "v", "o"), H="i32", N="i32", qk_scale="fp32", eps_raw="fp32", beta="fp32",
                   max_shift2="fp32")
        out[f"fwd_causal{int(causal)}_stab{int(stab)}"] = compile_one(gk.build_fwd_kernel(), sig, dict(
            CAUSAL=causal, HAS_STAB=stab, HEAD_DIM=256, BLOCK_M=128, BLOCK_N=64, num_warps=8))
sig = dict(q_desc=desc(128), k_desc=desc(64), v_desc=desc(64), do_desc=desc(128), dq_desc=desc(128), O="*bf16",
           DO="*bf16", LSE2="*fp32", Delta="*fp32", **geometry("q", "k", "v", "do", "dq"))
sig.update({n: "i32" for n in ("o_sb", "o_sh", "o_sn", "do_sb", "do_sh", "do_sn", "H", "N")})
sig.update(qk_scale="fp32", scale="fp32")
for from_o in (True, False):
    out[f"dq_delta_from_o{int(from_o)}"] = compile_one(gk.build_dq_kernel(), sig, dict(
        CAUSAL=True, DELTA_FROM_O=from_o, HEAD_DIM=256, BLOCK_M=128, BLOCK_N=64, num_warps=8))
print(json.dumps(out))
"""


@pytest.mark.skipif(not _have_gluon_hopper(), reason="this Triton has no Gluon for Hopper")
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """The three kernels (dK/dV, the forward, dQ) compiled for sm_90 with Triton's ptxas on this machine
    (no GPU needed): wgmma, no local-memory stack (a spill would make them slower than the Triton
    kernels they replace), one program's shared memory within the H100's. The causal forward holds
    243 registers with Triton 3.6's ptxas (the lent GPUs'), and spills 8 bytes with the tie
    tracking of stabilized heads; Triton 3.9's ptxas spills 8 and 40 bytes of them, so these two
    may keep at most 16 and 64. In a process of its own, without the tests'
    interpreter and its BF16 shim, and with a Triton cache of its own (a cached kernel would skip
    the compile)."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("no cuobjdump bundled with this Triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(ga.__file__)) + "/..",
                                                    env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    spill_cap = {"fwd_causal1_stab0": 16, "fwd_causal1_stab1": 64}  # bytes (see the docstring)
    assert set(got) == {"dkdv", "dq_delta_from_o1", "dq_delta_from_o0", *(
        f"fwd_causal{c}_stab{s}" for c in (0, 1) for s in (0, 1))}
    for name, rec in got.items():
        assert rec["wgmma"], (name, rec)
        assert rec["stack"] <= spill_cap.get(name, 0), (name, rec)
        assert rec["shared"] <= 227 * 1024, (name, rec)
