"""How many PyTorch operations one packed call of our kernels dispatches around its kernels (issue 43: the packed
call was set by its host time on the GPU, 2026-11-28). Runs on the CPU: the kernel launches are stubbed out (their
outputs are left unwritten), and a dispatch mode counts every other operation of one forward + backward of
``flash_attention_varlen``, for a call that finds its documents' tile ranges afresh and for one whose documents a
watch keeps (the step's later layers).

Run:  python benchmarks/packed_call_ops.py [--tokens 11000] [--docs 10]
"""
from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: no GPU needed

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from instability_watch import flash_attention_varlen  # noqa: E402
from instability_watch.kernels.attention import ops  # noqa: E402
from instability_watch.kernels.attention import triton as kernels  # noqa: E402


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=11000)
    ap.add_argument("--docs", type=int, default=10)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    for name in ("launch_fwd", "launch_dq", "launch_dkdv", "launch_delta"):
        setattr(kernels, name, lambda *a, **k: None)
    g = torch.Generator().manual_seed(0)
    cuts = torch.randperm(args.tokens - 1, generator=g)[: args.docs - 1].add(1).sort().values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([args.tokens])]).to(torch.int32)
    q = torch.zeros(args.tokens, args.heads, args.head_dim, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.zeros(args.tokens, args.kv_heads, args.head_dim, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    do = torch.zeros(args.tokens, args.heads, args.head_dim, dtype=torch.bfloat16)

    def call(keep: bool) -> collections.Counter:
        count = Count()
        with count:
            if keep:  # as a watch keeps them: around the forward (the backward comes later)
                with ops.keeping_documents():
                    o = flash_attention_varlen(q, k, v, cu, causal=True, backend="triton")
            else:
                o = flash_attention_varlen(q, k, v, cu, causal=True, backend="triton")
            o.backward(do)
        return count.ops

    ops.forget_documents()
    afresh = call(False)
    call(True)  # a step's first layer: its documents found and kept
    kept = call(True)
    ops.forget_documents()
    print(f"{args.tokens} tokens, {args.docs} documents, H {args.heads}/{args.kv_heads}, D {args.head_dim}, causal: "
          f"PyTorch operations in one forward + backward, launches not counted")
    print(f"  documents found afresh: {sum(afresh.values())}")
    print(f"  documents kept:         {sum(kept.values())}  ({', '.join(f'{n} {c}' for n, c in kept.most_common())})")


if __name__ == "__main__":
    main()
