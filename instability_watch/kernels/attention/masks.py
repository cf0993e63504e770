"""The host side of the mask pre-pass (kernels: ``triton_ranges.py``): a call's mask as the attention kernels read
it, and each tile's ranges of keys (of query rows, for a key tile): the kernels skip the key tiles no row of the
tile sees, read no mask over the tiles every row sees whole, and over a boolean mask's tiles that equal the causal
mask (its diagonal ones, most often) compare positions instead of reading it: a switched FlexAttention call with a
causal ``mask_mod`` spent a sixth of its time reading its mask (H200, 2026-11-28; RESULTS.md).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from instability_watch.kernels.attention.triton_ranges import mask_flag_ranges, mask_tile_flags, tile_order
from instability_watch.kernels.common import MASK_FLOOR, mask4
from instability_watch.kernels.launch import INTERPRET, Launcher, cdiv
from instability_watch.kernels.triton_common import MASK_ADD, MASK_BOOL, MASK_NONE

launch_flags, launch_flag_ranges = Launcher(mask_tile_flags), Launcher(mask_flag_ranges)
launch_tile_order = Launcher(tile_order)

# A boolean mask's tiles that equal the causal mask, beside its run of whole tiles, are computed with the causal
# compare, not the mask read (the pre-pass finds them: ``triton_ranges.CAUSAL_TILE``), by the kernels that do not
# read them anyway (``triton.READ_CAUSAL_TILES``: by default dQ only). Off: read as any other tile.
CAUSAL_TILES = True
# The pre-pass reads a boolean mask four keys at a time (int32 words) where its layout allows: rows that start on
# 4-byte boundaries, a multiple of 4 keys. Off: byte by byte (the benchmarks' variant).
FLAG_WORDS = True
# The mask is read once a call: the forward reads it for the flags of its FLAG_BASE x FLAG_BASE tiles, which the
# backward gets from it (the op's third output), and each kernel's tile shape takes its flags from those (any tile
# a multiple of the base; others read the mask for their own). A call read it three times before (the forward's
# tile, dQ's and dK/dV's), about 0.01 ms each on a 4,096 x 4,096 mask (H200, 2026-11-29). Off (FLAGS_ONCE False,
# or FLAG_BASE None): the mask read once per tile shape. Both are read at each call (set them between calls, not
# between a forward and its backward); the op's flags have FLAG_BASE's shape either way (a compiled graph's
# outputs keep their shapes when FLAGS_ONCE changes).
FLAG_BASE: Optional[int] = 16 if INTERPRET else 64
FLAGS_ONCE = True


def _extent(attn_mask: torch.Tensor, n_kv: int) -> torch.Tensor:
    """The mask's own extent (B_m, H_m, rows, n_kv), what the pre-passes read: a dim broadcast, or of stride 0,
    is size 1 (a view of ``attn_mask``, no copy)."""
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    for d in range(3):
        if m.shape[d] > 1 and m.stride(d) == 0:
            m = m.narrow(d, 0, 1)
    return m.expand(*m.shape[:3], n_kv)


def base_flag_shape(attn_mask: Optional[torch.Tensor], n_kv: int) -> Tuple[int, ...]:
    """The shape of a call's base tile flags (:data:`FLAG_BASE`): ``(B_m, H_m, row tiles, key tiles)`` over the
    mask's own extent, or ``(0,)`` where there are none (no mask, or no :data:`FLAG_BASE`)."""
    if attn_mask is None or not FLAG_BASE:
        return (0,)
    return _base_shape(_extent(attn_mask, n_kv).shape)


def _base_shape(extent) -> Tuple[int, ...]:
    bm_, hm_, rows, n_kv = extent
    return (bm_, hm_, cdiv(rows, FLAG_BASE), cdiv(n_kv, FLAG_BASE))


def expanded_ranges(ranges: torch.Tensor, shape):
    """Ranges (..., R) expanded to ``shape`` + (R,) (broadcast dims of stride 0); the strides of ``shape``'s dims."""
    ranges = ranges.expand(*shape, ranges.shape[-1])
    return ranges, ranges.stride()[:3]


def _as_words(m: torch.Tensor):
    """A uint8 mask (B_m, H_m, rows, N_kv) as int32 words of four keys, ``(tensor, strides in words)``, where its
    rows start on 4-byte boundaries (keys contiguous, N_kv, every stride and the start multiples of 4); else None.
    The tensor is a flat int32 view of the storage from the mask's start (the kernel adds the strides)."""
    if m.stride(-1) != 1 or m.shape[-1] % 4 or any(s % 4 for s in m.stride()[:3]) or m.data_ptr() % 4:
        return None
    flat = m.as_strided((m.untyped_storage().nbytes() - m.storage_offset(),), (1,))
    whole_words = flat.numel() // 4
    return flat[:whole_words * 4].view(torch.int32), (*(s // 4 for s in m.stride()[:3]), 1)


class MaskArgs:
    """The call's mask as the kernels read it: kind, pointer and strides, and each tile's ranges (pre-passes)."""

    def __init__(self, attn_mask: Optional[torch.Tensor], B: int, H: int, N: int, n_kv: int,
                 flags: Optional[torch.Tensor] = None, fill: bool = False):
        """``flags``: the call's base tile flags (:func:`base_flag_shape`), read from the mask where ``fill`` (the
        forward: its tensor is filled at the first tile shape asked for), else as given (the backward; flags of
        another shape are not used)."""
        self.kind = MASK_NONE
        self.tensor = None
        self.strides = (0, 0, 0, 0)
        self._vis = None
        self._shape = (B, H, N, n_kv)
        self._ranges = {}
        self._base = None  # the base tile flags, once read (or as given)
        self._fill = None  # the tensor to read them into
        if attn_mask is None:
            return
        m4 = mask4(attn_mask, B, H, N, n_kv)
        self.kind = MASK_BOOL if m4.dtype == torch.bool else MASK_ADD
        self.tensor = m4.view(torch.uint8) if self.kind == MASK_BOOL else m4
        self.strides = m4.stride()
        self._vis = _extent(attn_mask, n_kv)  # an additive mask's keys at or below MASK_FLOOR are unseen (NaN: seen)
        given = FLAGS_ONCE and FLAG_BASE and flags is not None and flags.numel() > 0
        if given and tuple(flags.shape) == _base_shape(self._vis.shape):
            if fill:
                self._fill = flags
            else:
                self._base = flags

    def _base_flags(self) -> Optional[torch.Tensor]:
        """The base tile flags (:data:`FLAG_BASE`), read from the mask at the first call (into the forward's
        tensor where it has one), or None: the mask read per tile shape."""
        if self._base is None and FLAGS_ONCE and FLAG_BASE:
            self._base = self._launch_flags(False, FLAG_BASE, FLAG_BASE, self._fill)
        return self._base

    def fill_flags(self) -> None:
        """Read the base tile flags into the forward's tensor (for its backward), if no tile shape asked yet."""
        if self._fill is not None:
            self._base_flags()

    def _launch_flags(self, cols: bool, block_m: int, block_n: int, out: Optional[torch.Tensor] = None):
        """The flags kernel (``triton_ranges.mask_tile_flags``) over the mask's own extent: (B_m, H_m, tiles,
        other tiles) uint8, into ``out`` where given."""
        vis = self._vis
        bm_, hm_, rows, n_kv = vis.shape
        tiles = cdiv(n_kv, block_n) if cols else cdiv(rows, block_m)
        other = cdiv(rows, block_m) if cols else cdiv(n_kv, block_n)
        flags = out if out is not None else torch.empty((bm_, hm_, tiles, other), dtype=torch.uint8,
                                                        device=vis.device)
        m = vis.view(torch.uint8) if vis.dtype == torch.bool else vis  # read in place: no copy of the mask
        words = _as_words(m) if self.kind == MASK_BOOL and FLAG_WORDS else None
        if words is not None:  # four keys a word (the same memory)
            m, strides = words
        else:
            strides = m.stride()
        launch_flags((tiles * other, bm_ * hm_), (m, flags),
                     (*strides, *flags.stride()[:3], hm_, rows, n_kv, other),
                     dict(COLS=cols, ADDITIVE=self.kind == MASK_ADD, BLOCK_M=block_m, BLOCK_N=block_n,
                          WORDS=words is not None, num_warps=4))
        return flags

    def _launch_ranges(self, cols: bool, block_m: int, block_n: int) -> torch.Tensor:
        """The pre-pass kernels (``triton_ranges.py``) over the mask's own extent: (B_m, H_m, tiles, 5) int32;
        the tiles' flags made from the base tiles' where the tile is a multiple of them, else read for it."""
        bm_, hm_, rows, n_kv = self._vis.shape
        tiles = cdiv(n_kv, block_n) if cols else cdiv(rows, block_m)
        other = cdiv(rows, block_m) if cols else cdiv(n_kv, block_n)
        out = torch.empty((bm_, hm_, tiles, 5), dtype=torch.int32, device=self._vis.device)
        base = self._base_flags() if FLAG_BASE and not (block_m % FLAG_BASE or block_n % FLAG_BASE) else None
        if base is None:
            flags = self._launch_flags(cols, block_m, block_n)
            sub, s_t, s_o, r_t, r_o = (1, 1), flags.stride(2), 1, tiles, other
        else:  # (B_m, H_m, row tiles, key tiles) of FLAG_BASE: a key tile's flags run down a column
            flags = base
            sub = (block_n // FLAG_BASE, block_m // FLAG_BASE) if cols else (block_m // FLAG_BASE, block_n // FLAG_BASE)
            s_t, s_o = (base.stride(3), base.stride(2)) if cols else (base.stride(2), base.stride(3))
            r_t, r_o = (base.shape[3], base.shape[2]) if cols else (base.shape[2], base.shape[3])
        launch_flag_ranges((tiles, bm_ * hm_), (flags, out),
                           (*flags.stride()[:2], s_t, *out.stride()[:3], hm_, other, rows if cols else n_kv,
                            s_o, r_t, r_o),
                           dict(UNIT=block_m if cols else block_n, CHUNK=256, WANT_WHOLE=self.kind == MASK_BOOL,
                                WANT_CAUSAL=self._want_causal(), COLS=cols, T_SUB=sub[0], O_SUB=sub[1],
                                num_warps=4, num_stages=1))
        return out

    def _want_causal(self) -> bool:
        """Whether the pre-pass looks for causal tiles: a boolean mask given row by row (a row broadcast to every
        query tile is not causal there)."""
        return CAUSAL_TILES and self.kind == MASK_BOOL and self._vis.shape[2] == self._shape[2]

    def rows(self, block_m: int, block_n: int):
        """``(ranges, strides)``: per (batch, head, query tile), int32 ``(lo, hi, whole_lo, whole_hi, causal_hi)``:
        the first and past-the-last key any row may see, the first run of key tiles every row sees whole (no mask
        read there; ``(0, 0)`` if none; none for an additive mask, which adds its values everywhere), and from the
        whole run's end (or ``lo``) to ``causal_hi`` a run of key tiles that equal the causal mask (no mask read
        there either)."""
        key = ("rows", block_m, block_n)
        if key not in self._ranges:
            B, H, N, _ = self._shape
            # (a mask of one row, every row the same: that row's ranges serve every query tile)
            ranges = self._launch_ranges(False, block_m, block_n)
            self._ranges[key] = expanded_ranges(ranges, (B, H, cdiv(N, block_m)))
        return self._ranges[key]

    def cols(self, block_n: int, block_m: int):
        """``(ranges, strides)``: per (batch, head, key tile), int32 ``(lo, hi, whole_lo, whole_hi, causal_lo)``
        over query rows: the first and past-the-last row that may see a key of the tile, the first run of query
        tiles that see all of it, and from ``causal_lo`` to the whole run's start (or ``hi``) a run of tiles that
        equal the causal mask (``triton_ranges.mask_flag_ranges``)."""
        key = ("cols", block_n, block_m)
        if key not in self._ranges:
            B, H, N, n_kv = self._shape
            if self._vis.shape[2] > 1:
                ranges = self._launch_ranges(True, block_m, block_n)
            else:  # every row sees the same keys: all rows or none
                vis = self._vis[:, :, 0] if self.kind == MASK_BOOL else ~(self._vis[:, :, 0].float() <= MASK_FLOOR)
                n_tiles = cdiv(n_kv, block_n)
                if n_tiles * block_n != n_kv:
                    vis = torch.cat([vis, vis.new_zeros((*vis.shape[:2], n_tiles * block_n - n_kv))], dim=2)
                tiles = vis.reshape(*vis.shape[:2], n_tiles, block_n)
                seen = tiles.any(dim=3)
                whole = tiles.all(dim=3) if self.kind == MASK_BOOL else torch.zeros_like(seen)
                zero = torch.zeros_like(seen, dtype=torch.int32)
                hi = torch.where(seen, N, 0).to(torch.int32)
                w0 = torch.where(whole, zero, hi)  # (as the pre-pass: without a run of whole tiles, at hi)
                ranges = torch.stack([zero, hi, w0, torch.where(whole, cdiv(N, block_m) * block_m, hi).to(torch.int32),
                                      w0], dim=-1)
            self._ranges[key] = expanded_ranges(ranges, (B, H, cdiv(n_kv, block_n)))
        return self._ranges[key]


def mask_row_ranges(attn_mask: torch.Tensor, B: int, H: int, N: int, n_kv: int, block_m: int, block_n: int):
    """``(ranges, strides)`` of a boolean or additive mask broadcastable to (B, H, N, N_kv): per (batch, head,
    query tile of ``block_m`` rows), int32 ``(lo, hi, whole_lo, whole_hi, causal_hi)`` in keys, tiles of ``block_n``
    (:meth:`MaskArgs.rows`; the pre-pass's two launches over the mask's own extent). Keys outside ``[lo, hi)`` are masked
    for every row of the tile (an additive mask's entries at or below ``MASK_FLOOR``)."""
    return MaskArgs(attn_mask, B, H, N, n_kv).rows(block_m, block_n)


def tiles_by_work(ranges: torch.Tensor) -> torch.Tensor:
    """The tiles of ``ranges`` ([B, [H,]] T, R) int32 (broadcast dims of stride 0 allowed) by their widest span
    ``hi - lo`` over the batch entries and heads, widest first, ties in tile order: int32 (T,), a permutation
    (``torch.argsort(span, descending=True, stable=True)`` of the spans' maximum), on the device in one launch,
    no host sync."""
    while ranges.dim() < 4:
        ranges = ranges.unsqueeze(0)
    for d in (0, 1):  # a broadcast dim (stride 0) holds one plane's spans again: read it once
        if ranges.shape[d] > 1 and ranges.stride(d) == 0:
            ranges = ranges.narrow(d, 0, 1)
    B, H, T = ranges.shape[:3]
    order = torch.empty(T, dtype=torch.int32, device=ranges.device)
    block_t = max(16, 1 << (T - 1).bit_length())
    launch_tile_order((T,), (ranges, order), (*ranges.stride()[:3], H, B * H, T),
                      dict(BLOCK_T=block_t, num_warps=4 if block_t <= 1024 else 8, num_stages=1))
    return order
