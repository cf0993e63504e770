"""Output layouts of the kernels."""
from __future__ import annotations

from torch import Tensor


def empty_like_layout(like: Tensor, shape=None, dtype=None) -> Tensor:
    """An uninitialised ``(B, H, N, D)`` tensor laid out like ``like``.

    Models usually make ``q, k, v`` as transposed views of a ``(B, N, H, D)``
    projection; PyTorch's SDPA then returns ``O`` and the gradients in that
    layout, so the model's ``o.transpose(1, 2).contiguous()`` and the backward's
    reshapes are free. Kernels that write by strides can do the same.
    """
    B, H, N, D = like.shape if shape is None else shape
    dtype = like.dtype if dtype is None else dtype
    if like.stride(1) < like.stride(2):  # heads inside tokens: (B, N, H, D) memory
        return like.new_empty((B, N, H, D), dtype=dtype).transpose(1, 2)
    return like.new_empty((B, H, N, D), dtype=dtype)
