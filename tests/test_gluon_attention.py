"""The Gluon dK/dV kernel (D = 256, sm_90): which calls it takes, its TMA views, and that it compiles.

It runs only on a Hopper GPU (tests/test_triton_gpu.py checks its gradients there); here, on any
machine: the 2-D views its tiles are read through, the calls it refuses, the backward's fallback
under Triton's interpreter, and a compile for sm_90 with Triton's bundled ptxas (no GPU needed).
"""
import importlib.util

import pytest
import torch

from instability_watch.kernels import gluon_attention as ga


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


def test_backward_with_gluon_true_raises_where_it_cannot_serve():
    from instability_watch.kernels._launch import INTERPRET
    from instability_watch.kernels.triton_attention import attention_backward_lse2, attention_forward_lse2

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
from instability_watch.kernels import gluon_attention as ga

tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
layout = gl.NVMMASharedLayout.get_default_for([64, 256], gl.bfloat16)
sig = {n: f"tensordesc<bf16[64, 256],{layout!r}>" for n in ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc",
                                                            "dv_desc")}
sig.update(LSE2="*fp32", Delta="*fp32")
sig.update({f"{n}_{x}": "i32" for n in ("q", "k", "v", "do", "dk", "dv") for x in ("rb", "rh", "ch")})
sig.update(H="i32", N="i32", qk_scale="fp32", scale="fp32")
const = dict(CAUSAL=True, HEAD_DIM=256, BLOCK_M=64, BLOCK_N=64, num_warps=8)
sig.update({name: "constexpr" for name in const})
compiled = triton.compile(GluonASTSource(ga._get_kernel(), sig, const), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=8))
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(compiled.asm["cubin"])
    f.flush()
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
stack = re.search(r"STACK:(\d+)", usage)
print(json.dumps(dict(wgmma="wgmma.mma_async" in compiled.asm["ptx"], stack=int(stack.group(1)) if stack else None,
                      shared=compiled.metadata.shared, usage=usage[-300:])))
"""


@pytest.mark.skipif(not _have_gluon_hopper(), reason="this Triton has no Gluon for Hopper")
def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    """Compiled for sm_90 with Triton's ptxas on this machine (no GPU needed): wgmma, no local-memory
    stack (a spill would make it slower than the Triton passes it replaces), one program's shared
    memory within the H100's. In a process of its own, without the tests' interpreter and its
    BF16 shim, and with a Triton cache of its own (a cached kernel would skip the compile)."""
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
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["wgmma"], got
    assert got["stack"] == 0, got
    assert got["shared"] <= 227 * 1024, got
