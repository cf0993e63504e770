"""What every kernel shares, in PyTorch: the numeric constants, attention masks, and dropout's random numbers.

The constants (the stabilized kernel's ``beta``/``eps`` defaults and bounds, the
cap on its shift, the additive-mask floor) are defined once here; the Triton
kernels (:mod:`.triton_common`), the PyTorch emulation (:mod:`.attention.reference`),
the statistics passes (:mod:`.stats`) and the watch's configuration read them.

Dropout: every kernel draws the same keep mask from a call's seed, with Philox4x32
(Salmon et al., SC'11) in counter mode: :func:`dropout_bits` gives each entry 16
random bits, and an entry is dropped where they are below
``round(p * DROPOUT_LEVELS)`` (:func:`dropout_threshold`).
"""
from __future__ import annotations

from typing import Optional

import torch

DEFAULT_BETA = 2.0  # the authors' choice; the paper recommends beta in [2, 8]


DEFAULT_EPS = 1e-3  # the paper's tolerance for "the same maximum"


# beta's upper bound. The shift beyond the row maximum is capped at _MAX_SHIFT bits (below), so a
# beta above ~2^10 changes nothing but rows whose maximum is within 0.03 nats of zero; bounding it
# keeps (beta - 1) * rowmax finite in float32 for every finite score.
MAX_BETA = 1024.0


# scores, scale, eps and the shift are float32 in every kernel: a larger number cannot be represented
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


# Cap on the extra softmax shift of the stabilized variant, in bits (log2 units), per
# P dtype. BF16 shares float32's exponent range: 46 bits (~32 nats) leave ~80 bits of
# headroom before exp2() underflows. FP16's smallest normal is 2^-14, so a large
# shift would flush the whole row's P to zero there; 3 bits keep P's maximum >= 1/8.
_MAX_SHIFT = {torch.bfloat16: 46.0, torch.float16: 3.0, torch.float32: 46.0, torch.float64: 46.0}


LOG2E = 1.4426950408889634


# An additive mask's finite entries below this are raised to it (``-inf`` stays ``-inf``): a
# score near -3.4e38 would overflow to -inf in the kernels' log2 units. The result is SDPA's:
# such an entry's weight is 0 beside any other entry, and a row made only of them is uniform.
MASK_FLOOR = -1e30


# Dropout: 16 random bits per entry; an entry is dropped where its bits are below
# round(p * DROPOUT_LEVELS), so the probability used is p rounded to a multiple of 2^-16.
DROPOUT_LEVELS = 1 << 16


# Philox4x32 (Salmon et al., SC'11: "Parallel random numbers: as easy as 1, 2, 3"): the
# multipliers, the key increments (Weyl sequence) and the rounds.
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57


PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


PHILOX_ROUNDS = 10


_U32 = 0xFFFFFFFF


def max_shift_for(dtype: torch.dtype) -> float:
    """The cap, in bits (log2 units), on the stabilized variant's extra softmax shift for inputs of ``dtype``."""
    return _MAX_SHIFT[dtype]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the PyTorch paths compute in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H_kv, N, D) -> (B, H_kv * group, N, D): query head h reads KV head h // group."""
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def mask4(attn_mask: Optional[torch.Tensor], B: int, H: int, N: int, N_kv: int) -> Optional[torch.Tensor]:
    """``attn_mask`` as a ``(B, H, N, N_kv)`` view (broadcast dims get stride 0; no copy)."""
    if attn_mask is None:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m.expand(B, H, N, N_kv)


def mask_bias(block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a block of ``attn_mask`` adds to the scaled scores, in ``dtype``: a tensor of ``block``'s shape.

    Boolean: 0 where True (attend), ``-inf`` where False. Floating: the entries,
    with finite ones below :data:`MASK_FLOOR` raised to it (``-inf`` and NaN kept).
    """
    if block.dtype == torch.bool:
        return torch.zeros(block.shape, dtype=dtype, device=block.device).masked_fill_(~block, float("-inf"))
    b = block.to(dtype)
    return torch.where((b < MASK_FLOOR) & ~torch.isneginf(b), MASK_FLOOR, b)


def reduce_to(grad: torch.Tensor, shape) -> torch.Tensor:
    """Sum a ``(B, H, N, N_kv)`` gradient over the dimensions a mask of ``shape`` was broadcast along."""
    lead = 4 - len(shape)
    full = (1,) * lead + tuple(shape)
    dims = tuple(i for i in range(4) if full[i] == 1 and grad.shape[i] != 1)
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape(shape)


def dropout_threshold(p: float) -> int:
    """Entries whose 16 random bits are below this are dropped: ``round(p * 2^16)``, at most ``2^16 - 1``."""
    return min(int(round(p * DROPOUT_LEVELS)), DROPOUT_LEVELS - 1)


def dropout_scale(p: float) -> float:
    """The factor kept entries are scaled by: ``1 / (1 - p_eff)``, ``p_eff`` the probability actually used."""
    return DROPOUT_LEVELS / (DROPOUT_LEVELS - dropout_threshold(p))


def dropout_seed(generator: Optional[torch.Generator], device) -> torch.Tensor:
    """The seed a call with dropout draws: two 32-bit words (int64 tensor of shape (2,) on ``device``).

    From ``generator`` (``None``: the default generator of ``device``, as
    ``torch.nn.functional.dropout`` and SDPA draw), on the generator's device, with
    no host sync on CUDA.
    """
    device = torch.device(device)
    if generator is None:
        return torch.randint(0, 1 << 32, (2,), dtype=torch.int64, device=device)
    seed = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, device=generator.device, generator=generator)
    return seed.to(device)


def _mulhilo(a: torch.Tensor, m: int):
    """``(hi, lo)`` 32-bit words of ``a * m`` for ``a`` (int64 tensor of values in [0, 2^32)) and a 32-bit ``m``."""
    al, ah = a & 0xFFFF, a >> 16
    ml, mh = m & 0xFFFF, m >> 16
    mid = al * mh + ah * ml  # < 2^33
    low = al * ml + ((mid & 0xFFFF) << 16)  # < 2^33
    return (ah * mh + (mid >> 16) + (low >> 32)) & _U32, low & _U32


def philox(key0, key1, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor):
    """Philox4x32-10 of the counters ``(c0, c1, c2, c3)`` under the key ``(key0, key1)``: four 32-bit words.

    All values are int64 tensors (or ints) holding 32-bit unsigned numbers; the
    counters broadcast. The Triton kernels compute the same words with 32-bit
    integer arithmetic.
    """
    k0, k1 = key0, key1
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W0) & _U32, (k1 + PHILOX_W1) & _U32
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def dropout_counter(cols: torch.Tensor) -> torch.Tensor:
    """The first Philox counter word of key columns ``cols``: ``4 (j // 32) + (j % 8) // 2`` (int64).

    Philox call ``c`` serves the 8 columns ``32 (c // 4) + 8 w + 2 (c % 4) + h`` (w < 4, h < 2):
    of every 8 columns the same pair, in four groups of 8. That is what one thread holds of
    a tensor-core (MMA) accumulator tile, so on the GPU each call's numbers stay in the
    thread that computed them.
    """
    return 4 * (cols // 32) + (cols % 8) // 2


def dropout_bits(seed: torch.Tensor, B: int, H: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The 16 random bits of the entries ``(b, h, rows, cols)``: int64 ``(B, H, len(rows), len(cols))``.

    Entry ``(b, h, i, j)`` takes Philox4x32-10 with key ``seed`` and counter
    ``(dropout_counter(j), i, b * H + h, 0)``, i.e. ``(4 (j // 32) + (j % 8) // 2, i, b H + h, 0)``;
    of the four words, word ``(j % 32) // 8``, and of that word the low 16 bits for even
    ``j``, the high 16 bits for odd ``j``. The numbers do not depend on any block size.
    """
    dev = rows.device
    key0, key1 = (int(x) & _U32 for x in seed.tolist()) if seed.device.type == "cpu" else (seed[0], seed[1])
    bh = torch.arange(B * H, dtype=torch.int64, device=dev).view(B, H, 1, 1)
    c1 = rows.to(torch.int64).view(1, 1, -1, 1)
    cols = cols.to(torch.int64)
    counter = dropout_counter(cols)
    calls = torch.unique(counter)  # sorted
    words = philox(key0, key1, calls.view(1, 1, 1, -1), c1, bh, torch.zeros((), dtype=torch.int64, device=dev))
    w = torch.stack(torch.broadcast_tensors(*words), dim=-1)  # (B, H, n, calls, 4)
    word = w[:, :, :, torch.searchsorted(calls, counter), (cols % 32) // 8]  # (B, H, n, len(cols))
    return (word >> (16 * (cols % 2))) & 0xFFFF


def dropout_mask(seed: torch.Tensor, B: int, H: int, N: int, N_kv: int, p: float, device=None) -> torch.Tensor:
    """The keep mask (True = kept) that a call with dropout probability ``p`` and this ``seed`` applies to ``P``.

    ``(B, H, N, N_kv)`` bool on ``device`` (default: the seed's); see
    :func:`dropout_bits` for the numbers, :func:`dropout_threshold` for the rule.
    """
    device = seed.device if device is None else torch.device(device)
    seed = seed.to(device)
    rows = torch.arange(N, device=device)
    cols = torch.arange(N_kv, device=device)
    return dropout_bits(seed, B, H, rows, cols) >= dropout_threshold(p)


def documents(cu_q: torch.Tensor, cu_k: torch.Tensor, t_q: int, t_k: int):
    """``(doc_q, pos_q, doc_k, pos_k)``, int64 on the device: each query row's document (``n``, the number of
    documents, past the last) and its position aligned to the document's keys (bottom-right), each key's
    document (``n + 1`` past the last) and its position within it. No host sync."""
    cu_q, cu_k = cu_q.long(), cu_k.long()
    rows = torch.arange(t_q, device=cu_q.device)
    keys = torch.arange(t_k, device=cu_q.device)
    n = cu_q.numel() - 1
    doc_q = torch.searchsorted(cu_q[1:], rows, right=True)
    doc_k = torch.searchsorted(cu_k[1:], keys, right=True)
    dq, dk = doc_q.clamp(max=n - 1), doc_k.clamp(max=n - 1)
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    pos_q = rows - cu_q[dq] + (len_k[dq] - len_q[dq])
    pos_k = keys - cu_k[dk]
    doc_k = torch.where(doc_k >= n, n + 1, doc_k)  # keys past the last document: seen by no row
    return doc_q, pos_q, doc_k, pos_k
