"""Our attention kernels' registers, stack (spills) and shared memory on sm_90, found on a machine without a GPU.

A switched FlexAttention call's kernels (a boolean mask, BF16, D 128, GQA 4:1, one stabilized head: the call of
``flex_switch_speed.py``) are recorded on the CPU, their launch arguments taken as our launchers pass them (one
small call in a child process, the kernels not run), then each kernel is compiled for the GPU's
architecture with the launch config the GPU's table gives it (or ``--config``), and ``cuobjdump -res-usage`` reads
the cubin. Nothing runs on a GPU, so a kernel change that makes a kernel spill is seen before a device call.

The numbers are the GPU's only with the GPU's Triton (3.6 on the lent machines): the same source compiled by
another Triton allocates registers differently. Install it beside the project's:

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install torch==2.13.0 triton==3.6.0 numpy pandas rich
    PYTHONPATH=. /tmp/t36/bin/python benchmarks/kernel_resources.py [--mask sliding|causal|documents]
        [--config attn_bwd_dq=64,64,8,2] [--set attn_bwd_dq.EDGE_LOOP=1] [--arch 90]

Checked on 2026-11-29 against the H200's own resources lines (triton 3.6.0): the forward with the edge loop at
(128, 64, 8, 3) gives 217 registers, no stack, 147,456 bytes of shared memory, as on the GPU; the commit whose
forward spilled there (255 registers, 288 spills, 163,840 bytes) gives 255 registers, a 1,152-byte stack and
163,840 bytes. Triton 3.9 (the CPU tests' pin) does not reproduce that spill.
"""
from __future__ import annotations

import argparse
import os
import pickle
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the kernels of a boolean-mask call and their entries in the launch table
TABLE_ENTRY = {"attn_fwd": "fwd_mask", "attn_bwd_dq": "dq_mask", "attn_bwd_dkdv": "dkdv_mask"}


def _record(path: str, mask: str) -> None:
    """Make one small switched call (forward and backward) on the CPU, the kernels not run, and pickle each
    launch's kernel name, tensors (dtype, 16-byte aligned), scalars and meta."""
    import torch

    from instability_watch.kernels import flash_attention
    from instability_watch.kernels import launch

    launches = []

    def record(self, grid, tensors, scalars, meta, descs=()):
        launches.append((self.fn.__name__, [None if t is None else (t.dtype, t.data_ptr() % 16 == 0)
                                            for t in tensors], list(scalars), dict(meta)))
        # not run: only the arguments are wanted (and the interpreter would need the tests' BF16 shim, written
        # for another Triton); the outputs stay as allocated

    launch.Launcher.__call__ = record
    gen = torch.Generator().manual_seed(0)
    B, H, H_KV, N, D, W = 1, 4, 1, 256, 128, 64
    q, k, v = (torch.randn(B, h, N, D, generator=gen, dtype=torch.bfloat16).requires_grad_() for h in (H, H_KV, H_KV))
    i = torch.arange(N)
    keep = i[:, None] >= i[None, :]
    if mask == "sliding":
        keep = keep & (i[:, None] - i[None, :] < W)
    elif mask == "documents":
        keep = keep & (i[:, None] // (N // 4) == i[None, :] // (N // 4))
    stab = torch.zeros(H, dtype=torch.bool)
    stab[0] = True
    flash_attention(q, k, v, attn_mask=keep, stabilize=stab, backend="triton").float().sum().backward()
    with open(path, "wb") as f:
        pickle.dump(launches, f)


def _parse(configs, sets):
    out, fields = {}, {}
    for c in configs:
        name, _, value = c.partition("=")
        try:
            out[name] = tuple(int(x) for x in value.split(","))
            assert len(out[name]) == 4
        except (ValueError, AssertionError):
            raise SystemExit(f"--config takes KERNEL=BM,BN,WARPS,STAGES; got {c!r}")
    for s in sets:
        key, _, value = s.partition("=")
        name, _, field = key.partition(".")
        if not field or not value.lstrip("-").isdigit():
            raise SystemExit(f"--set takes KERNEL.FIELD=INT (0/1 for a flag); got {s!r}")
        fields.setdefault(name, {})[field] = int(value)
    return out, fields


def _compile(path: str, arch: int, configs, sets) -> list:
    """Compile each recorded attention kernel for ``sm_<arch>`` and read its resources from the cubin."""
    import torch
    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    from instability_watch.kernels.attention import triton as kernels
    from instability_watch.kernels.configs import LAUNCH_TABLE, TENSOR_CORES

    target = GPUTarget("cuda", arch, 32)
    backend = backends["nvidia"].compiler(target)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with open(path, "rb") as f:
        launches = pickle.load(f)
    rows, done = [], set()
    for name, tensors, scalars, meta in launches:
        if name not in TABLE_ENTRY or name in done:
            continue
        done.add(name)
        fn = getattr(kernels, name)
        cfg = configs.get(name)
        if cfg is None:
            c = LAUNCH_TABLE[(TABLE_ENTRY[name], TENSOR_CORES)][128]
            cfg = (c.block_m, c.block_n, c.num_warps, c.num_stages)
        meta = dict(meta, BLOCK_M=cfg[0], BLOCK_N=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
        if "ASM" in meta:
            meta["ASM"] = True  # the interpreter's launch turns it off
        for field, value in sets.get(name, {}).items():
            meta[field] = bool(value) if isinstance(meta.get(field), bool) else value
        options = {k: meta.pop(k) for k in ("num_warps", "num_stages")}
        args = [None if t is None else torch.empty(64, dtype=t[0]) for t in tensors] + scalars
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = binder(*args, **meta, **options)
        opts, signature, constexprs, attrs = fn._pack_args(backend, {**meta, **options}, bound, spec, opts)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=opts.__dict__)
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
        flags = {k: meta[k] for k in ("EDGE_LOOP", "MASK_KIND", "HAS_STAB") if k in meta}
        rows.append((name, cfg, flags, regs and int(regs.group(1)), stack and int(stack.group(1)),
                     compiled.metadata.shared))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mask", choices=["causal", "sliding", "documents"], default="sliding")
    ap.add_argument("--config", action="append", default=[], metavar="KERNEL=BM,BN,WARPS,STAGES",
                    help="a launch config in place of the table's (attn_fwd, attn_bwd_dq, attn_bwd_dkdv)")
    ap.add_argument("--set", action="append", default=[], metavar="KERNEL.FIELD=INT",
                    help="a constexpr in place of the launch's, e.g. attn_bwd_dq.EDGE_LOOP=1")
    ap.add_argument("--arch", type=int, default=90, help="the compute capability, as 90 for sm_90 (H100, H200)")
    ap.add_argument("--record", metavar="PATH", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.record:
        _record(args.record, args.mask)
        return 0
    configs, sets = _parse(args.config, args.set)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.pkl")
        env = dict(os.environ, TRITON_INTERPRET="1")
        subprocess.run([sys.executable, __file__, "--mask", args.mask, "--record", path], env=env, check=True)
        rows = _compile(path, args.arch, configs, sets)
    import triton

    print(f"sm_{args.arch}, triton {triton.__version__}, a switched call with a {args.mask} boolean mask")
    print(f"{'kernel':15s} {'config':18s} {'flags':50s} {'regs':>5s} {'stack':>6s} {'shared':>7s}")
    for name, cfg, flags, regs, stack, shared in rows:
        print(f"{name:15s} {str(cfg):18s} {str(flags):50s} {regs!s:>5s} {stack!s:>6s} {shared:>7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
