"""Triton flash attention with FA2's precision model, per-head stabilization and in-kernel diagnostics.

This module is the host side: the dropout arguments, a packed call's documents, and
the functions that launch the kernels (a mask's arguments and its tiles' ranges:
``masks.py``). The kernels: the forward (``triton_fwd.py``), the backward
(``triton_bwd.py``: dQ, which also computes delta and the shadow delta_hp, then
dK/dV), the Gluon kernels for D = 256 on Hopper (``gluon.py``). Elsewhere: the
helpers the Triton kernels share (``../triton_common.py``), the launch table
(``../configs.py``), the launch path and its Triton version pins (``../launch.py``).
The numerics are those of ``reference.py`` (the test oracle):

* ``S = q.k`` in float32 from the low-precision ``Q, K``; the softmax scale is
  applied in the exponent, in log2 units (``qk_scale = scale * log2(e)``);
* ``P = exp2(q.k * qk_scale - m)`` in float32 (one FMA and one exp2 per score, as
  FA2), with the shift ``m = r * qk_scale`` for ``r`` the running maximum of the
  raw scores (stabilized rows: ``max(m_old, r * qk_scale + d)``, ``d`` the
  stabilized shift in bits, > 0 on a repeated maximum);
  ``l`` summed from the float32 ``P``; ``P`` rounded to the
  input dtype for ``P V`` with a float32 accumulator; ``O = acc / l`` rounded once;
* the log-sum-exp is stored in log2 units (``LSE2``) for the backward, which
  recomputes ``P = exp2(q.k * qk_scale - LSE2)`` (FA2's backward, unchanged by
  stabilization).

Stabilized heads (a per-head flag read from a tensor, so flipping one never
recompiles) move the softmax shift above the row maximum where that maximum is
repeated within ``eps``, tested against the running maximum of all blocks so far
(see reference.py for why, and for the cap on the shift). The same tie test
feeds the probe's ``multi_max_rows``.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

from instability_watch.kernels.attention.alloc import empty_like_layout
from instability_watch.kernels.attention.masks import MaskArgs, tiles_by_work
from instability_watch.kernels.attention.triton_bwd import attn_bwd_delta, attn_bwd_dkdv, attn_bwd_dq
from instability_watch.kernels.attention.triton_fwd import attn_fwd
from instability_watch.kernels.common import (
    documents,
    LOG2E,
    dropout_scale,
    dropout_threshold,
    max_shift_for,
    reduce_to,
)
from instability_watch.kernels.configs import LaunchConfig, has_launch_config, head_dim_tile, launch_config
from instability_watch.kernels.launch import INTERPRET, Launcher, cdiv, dot_precision
from instability_watch.kernels.triton_common import (
    EDGE_READ, EDGE_SELECT, MASK_ADD, MASK_BOOL, MASK_DOCS, MASK_NONE,
)

launch_fwd, launch_dq, launch_dkdv = Launcher(attn_fwd), Launcher(attn_bwd_dq), Launcher(attn_bwd_dkdv)
launch_delta = Launcher(attn_bwd_delta)


TIE_SAMPLE_MAX = 16  # at most 1 in 16 query tiles of unstabilized heads track ties for the probe

# The dK/dV kernel's grouped-query mode (attention_backward_lse2's ``gqa_expand``): off until measured on the GPU
# (benchmarks/varlen_speed.py and flex_switch_speed.py time it as a variant).
GQA_EXPAND = False
# The fused backward (one dK/dV kernel adding dQ by atomics) where ``fused=None`` leaves the choice: None takes the
# rule (calls with dropout at D <= 128); True or False, every call that can (not shadow steps, a mask's gradient or
# deterministic algorithms). For the benchmarks' variants: measured faster on dense calls with dropout only, not yet
# on packed or masked calls (benchmarks/varlen_speed.py and flex_switch_speed.py time it).
FUSED_BACKWARD: Optional[bool] = None
# Launch each kernel's tiles widest range first, the heads of one tile together (grid (batch x heads, tiles)), so
# that the longest programs do not start last (a packed call's tiles differ in work by their place in their
# document). None (the default): packed calls (H200, 2026-11-28: 2.45 ms a forward + backward, 3.22 in grid order;
# the order kept with the documents) and calls with a boolean mask (the order found on the device in one launch:
# switched flex calls 3.11 ms against 3.47 causal, 1.89 against 1.90 sliding, 1.77 against 2.04 documents; RESULTS.md),
# not additive masks (not measured); True: those too; False: never.
TILE_ORDER: Optional[bool] = None
# The kernels that walk a boolean mask's tiles outside its run of whole tiles in one loop (the tiles equal to the
# causal mask compared by position within it), then the whole run: two loops where there were four. H200,
# 2026-11-29 (switched flex calls; RESULTS.md): the forward and dK/dV faster with it, dQ slower (its registers
# spill); "dq" may be added, () is the four loops everywhere (flex_switch_speed.py's variants).
EDGE_LOOP: Tuple[str, ...] = ("fwd", "dkdv")
# dK/dV's loads of query rows without a mask where every query block is whole and D fills the tile (EVEN_MD): fewer
# spills (sm_90, triton 3.6: 12 in place of 18 on a switched sliding call). H200, 2026-11-29 (RESULTS.md): switched
# flex calls faster with it, sliding 1.634 against 1.656 ms (flex_switch_speed.py's "switched, dK/dV masked loads").
EVEN_LOADS = True
# dQ's loads of K/V rows without a mask where every KV block is whole and D fills the tile (EVEN_ND; with
# EVEN_LOADS). H200, 2026-11-29 (RESULTS.md): switched sliding calls 1.620 against 1.639 ms (flex_switch_speed.py's
# "switched, dQ masked loads").
EVEN_DQ = True
# The kernels that read a boolean mask's tiles equal to the causal mask as they read any other (no causal compare):
# the forward's and dK/dV's edge loops (EDGE_LOOP) read every tile outside the whole run, dQ reads the tiles after
# it in one loop; elsewhere the causal compare takes those tiles (in the edge loop, one select between it and the
# mask read on every tile; in dQ, a loop of their own). The same bits either way. H200, 2026-11-29 (RESULTS.md;
# flex_switch_speed.py's "switched, causal tiles compared"): the forward and dK/dV reading faster on switched flex
# calls, sliding 1.564 against 1.614 ms, causal 2.740 against 2.810, documents 1.448 against 1.490; a branch a tile
# between the two (only one of them on each tile) was slower than either (sliding 1.697). dQ reading was no faster
# (sliding 1.558-1.570 against 1.553-1.565; "switched, dQ causal tiles compared").
READ_CAUSAL_TILES: Tuple[str, ...] = ("fwd", "dkdv")


def _launch_grid(tiles: int, heads: int, mask, key, ranges):
    """``(grid, order, ordered)`` of a launch over ``tiles`` tiles of ``heads`` (batch x heads) programs each: with
    :data:`TILE_ORDER` and ranges, the tiles sorted by the widest span any (batch, head) of them has (a permutation,
    int32 on the device, cached with the mask's ranges), else the plain grid."""
    ordered = (isinstance(mask, Documents) or getattr(mask, "kind", None) == MASK_BOOL) if TILE_ORDER is None \
        else TILE_ORDER
    if not ordered or ranges is None:
        return (tiles, heads), None, False
    orders = mask.__dict__.setdefault("_orders", {})
    if key not in orders:
        orders[key] = tiles_by_work(ranges)
    return (heads, tiles), orders[key], True


class Documents:
    """A packed call's documents as the kernels read them (MASK_DOCS): the document vector, the kernels' mask
    stride arguments ``(n_docs, win_l, win_r, 0)``, and each tile's ranges (of keys, or for a key tile of query
    rows) found on the device from ``cu_seq_q``/``cu_seq_k``: no mask is formed and no host sync made.

    The calls are ``(1, H, T, D)`` views of the packed ``(T, H, D)`` tensors; a key is seen from its own
    document within ``window`` (bottom-right aligned positions; a negative bound: none).
    """

    kind = MASK_DOCS

    def __init__(self, cu_q: torch.Tensor, cu_k: torch.Tensor, t_q: int, t_k: int, window) -> None:
        self.cu_q, self.cu_k = cu_q.long(), cu_k.long()
        self.n = cu_q.numel() - 1
        self.t_q, self.t_k = t_q, t_k
        self.doc_q, self.pos_q, self.doc_k, self.pos_k = documents(cu_q, cu_k, t_q, t_k)
        self.tensor = torch.cat([self.doc_q, self.pos_q, self.doc_k, self.pos_k])
        self.win_l, self.win_r = int(window[0]), int(window[1])
        self.strides = (self.n, self.win_l, self.win_r, 0)
        self._ranges = {}
        self._stats_vector = None

    def stats_vector(self) -> torch.Tensor:
        """The statistics kernel's document vector, int64 ``[doc_q, pos_q, doc_k, pos_k, cu_seq_k]`` (made once)."""
        if self._stats_vector is None:
            self._stats_vector = torch.cat([self.tensor, self.cu_k])
        return self._stats_vector

    def _seen(self, doc: torch.Tensor, past: int):
        """For each row (key): its document clamped to a real one, and whether it is in one."""
        return doc.clamp(max=self.n - 1), doc < past

    @staticmethod
    def _per_tile(lo: torch.Tensor, hi: torch.Tensor, inside: torch.Tensor, size: int, block: int, other: int):
        """Each tile's ranges from its rows' (keys') ranges ``[lo, hi)``: ``(ranges, strides)``, int32
        ``(lo, hi, full_lo, full_hi)``: the union of the rows' ranges (``(0, 0)`` for a tile none of whose rows
        sees anything), and their intersection in whole tiles of ``other`` (``(0, 0)`` if empty; a row in no
        document sees nothing, so its tile has none; the padding past ``size`` counts as seeing everything)."""
        big = 1 << 40  # past any length (and no overflow in the rounding below)
        pad = -size % block
        u_lo, u_hi = torch.where(inside, lo, big), torch.where(inside, hi, 0)
        i_lo, i_hi = u_lo, u_hi
        if pad:
            u_lo, u_hi = torch.cat([u_lo, u_lo.new_full((pad,), big)]), torch.cat([u_hi, u_hi.new_zeros(pad)])
            i_lo, i_hi = torch.cat([i_lo, i_lo.new_zeros(pad)]), torch.cat([i_hi, i_hi.new_full((pad,), big)])
        u_lo, u_hi = u_lo.view(-1, block).amin(dim=1), u_hi.view(-1, block).amax(dim=1)
        seen = u_hi > u_lo
        f0 = (i_lo.view(-1, block).amax(dim=1) + other - 1) // other * other
        f1 = i_hi.view(-1, block).amin(dim=1) // other * other
        whole = f1 > f0
        ranges = torch.stack([torch.where(seen, u_lo, 0), torch.where(seen, u_hi, 0),
                              torch.where(whole, f0, 0), torch.where(whole, f1, 0)], dim=-1).to(torch.int32)
        return ranges, (0, 0, 4)  # the same for every batch entry (one) and head

    def rows(self, block_m: int, block_n: int):
        """``(ranges, strides)`` per query tile: the keys its rows may see, within their documents and their
        window (a causal call's rows no key after their own position: ``win_r = 0``), and the key tiles all its
        rows see whole."""
        key = ("rows", block_m, block_n)
        if key not in self._ranges:
            d, inside = self._seen(self.doc_q, self.n)
            start, end = self.cu_k[d], self.cu_k[d + 1]
            at = start + self.pos_q  # the row's own key position (bottom-right aligned)
            lo = (at - self.win_l).clamp(min=start) if self.win_l >= 0 else start
            hi = torch.minimum(at + self.win_r + 1, end) if self.win_r >= 0 else end
            self._ranges[key] = self._per_tile(lo, hi, inside, self.t_q, block_m, block_n)
        return self._ranges[key]

    def cols(self, block_n: int, block_m: int):
        """``(ranges, strides)`` per key tile: the query rows that may see its keys (the transpose of rows), and
        the query tiles that see all of it."""
        key = ("cols", block_n, block_m)
        if key not in self._ranges:
            d, inside = self._seen(self.doc_k, self.n)
            start, end = self.cu_q[d], self.cu_q[d + 1]
            shift = (self.cu_k[d + 1] - self.cu_k[d]) - (end - start)  # len_k - len_q: row r sits at r - start + shift
            at = start + self.pos_k - shift  # the row whose own key position is this key
            lo = (at - self.win_r).clamp(min=start) if self.win_r >= 0 else start
            hi = torch.minimum(at + self.win_l + 1, end) if self.win_l >= 0 else end
            self._ranges[key] = self._per_tile(lo, hi, inside, self.t_k, block_n, block_m)
        return self._ranges[key]


def _whole_tiles(kind: int, causal: bool) -> bool:
    """Whether the kernels take the mask's whole tiles (every entry kept) without reading it: a boolean mask or
    documents; not with ``causal`` as well (the whole tiles' loop applies no mask at all)."""
    return kind in (MASK_BOOL, MASK_DOCS) and not causal


def _edge_how(kernel: str) -> int:
    """How ``kernel`` ("fwd", "dq" or "dkdv") takes a boolean mask's causal tiles, its constexpr ``EDGE_HOW``
    (:data:`READ_CAUSAL_TILES`)."""
    wrong = [k for k in READ_CAUSAL_TILES if k not in ("fwd", "dq", "dkdv")]
    if wrong:
        raise ValueError(f"READ_CAUSAL_TILES takes the kernels 'fwd', 'dq' and 'dkdv', got {wrong[0]!r}")
    return EDGE_READ if kernel in READ_CAUSAL_TILES else EDGE_SELECT


def _edge_loop(kernel: str, kind: int, causal: bool) -> bool:
    """Whether ``kernel`` ("fwd", "dq" or "dkdv") walks a boolean mask's tiles outside its whole run in one loop
    (:data:`EDGE_LOOP`)."""
    return kernel in EDGE_LOOP and kind == MASK_BOOL and _whole_tiles(kind, causal)


# launch-table entries of their own, measured on calls with documents or a boolean mask (where the table has one)
_OWN_ENTRIES = {("dkdv", MASK_DOCS): "dkdv_docs", ("dkdv", MASK_BOOL): "dkdv_mask", ("dq", MASK_BOOL): "dq_mask",
                ("fwd", MASK_BOOL): "fwd_mask"}


def _entry(kernel: str, kind: int, head_dim: int, dtype: torch.dtype) -> str:
    """The launch-table entry for ``kernel`` in a call with this mask kind: its own where measured, else the dense
    calls'."""
    own = _OWN_ENTRIES.get((kernel, kind))
    return own if own is not None and has_launch_config(own, head_dim, dtype) else kernel


def _dropout_args(dropout_p: float, seed: Optional[torch.Tensor]):
    if not dropout_p:
        return None, 0, 1.0
    return seed, dropout_threshold(dropout_p), dropout_scale(dropout_p)


def attention_forward_lse2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    causal: bool, scale: float, stabilize: Optional[torch.Tensor], beta: float, eps: float,
    counts: Optional[torch.Tensor], values: Optional[torch.Tensor], config=None,
    attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
    gluon: Optional[bool] = None, documents: Optional[Documents] = None, mask_flags: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward; ``config`` (a LaunchConfig or a tuple) overrides the launch configuration.

    q (B, H, N, D), k, v (B, H_kv, N_kv, D), bfloat16/float16/float32; ``stabilize`` bool (H,)
    or None; ``counts``/``values`` the probe's buffers or None. Returns ``(o, lse2)``: o
    (B, H, N, D) in q's dtype and layout, lse2 (B, H, N) float32 in log2 units (with an
    additive mask (2, B, H, N): the shift and log2(l) apart), for :func:`attention_backward_lse2`.
    ``gluon``: at D = 256 on an sm_90 GPU, a call without probe, mask, dropout or GQA (stabilized
    heads included) runs the Gluon forward (``gluon_attention.py``; the same online softmax and
    tie tracking); ``None`` does so where it can and ``config`` is not given, ``False`` never,
    ``True`` raises ValueError where it cannot. ``mask_flags``: uint8 of :func:`.masks.base_flag_shape`, filled
    with the mask's base tile flags for the backward (``attention_backward_lse2(mask_flags=...)``).
    """
    B, H, N, D = q.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o = empty_like_layout(q)  # PyTorch's layout: the model's transpose back is free
    mask = documents if documents is not None else MaskArgs(attn_mask, B, H, N, n_kv, mask_flags, fill=True)
    # an additive mask: (2, B, H, N), the shift and log2(l) (see the kernel's epilogue)
    lse_shape = (2, B, H, N) if mask.kind == MASK_ADD else (B, H, N)
    lse2 = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    # the kernels read the mask at Stab + head: one byte per head, contiguous (a strided mask too)
    stab = stabilize.contiguous().view(torch.uint8) if stabilize is not None else None
    if gluon if gluon is not None else (config is None and D == 256):
        why = "a probe, mask or dropout"
        if counts is None and mask.kind == MASK_NONE and not dropout_p:
            why = _gluon_call(
                "forward", lambda ga: ga.forward(q, k, v, o, lse2, causal=causal, qk_scale=scale * LOG2E,
                                                 stabilize=stab, eps_raw=eps / scale, beta=beta,
                                                 max_shift2=max_shift_for(q.dtype)),
                q, k, v, q, masked=False, block=128)
        if why is None:
            return o, lse2
        if gluon:
            raise ValueError(f"gluon=True: the Gluon forward cannot serve this call ({why})")
    head_dim = head_dim_tile(D)
    watched = stabilize is not None or counts is not None
    cfg = launch_config(_entry("fwd", mask.kind, head_dim, q.dtype), head_dim, q.dtype, watched=watched,
                        override=config)
    block_m, block_n = cfg.block_m, cfg.block_n
    # Query tiles per head in this call; sample about a quarter of them for the
    # multi-max statistic, at most 1 in TIE_SAMPLE_MAX (small calls: all of them).
    tiles = B * cdiv(N, block_m)
    tie_stride = max(1, min(TIE_SAMPLE_MAX, tiles // 4))
    has_probe = counts is not None
    ranges, r_strides = mask.rows(block_m, block_n) if mask.kind else (None, (0, 0, 0))
    seed, drop_thr, drop_scale = _dropout_args(dropout_p, seed)
    # an additive mask is added to the scaled scores, which the loop then takes in log2 units
    raw_scale = 1.0 / LOG2E if mask.kind == MASK_ADD else scale
    grid, order, ordered = _launch_grid(cdiv(N, block_m), B * H, mask, ("rows", block_m, block_n), ranges)
    launch_fwd(
        grid,
        (q, k, v, o, lse2, stab, counts, values, mask.tensor, ranges, order, seed),
        (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *mask.strides, *r_strides,
         H, H // h_kv, N, n_kv, D, B * H * N,
         1.0 if mask.kind == MASK_ADD else scale * LOG2E, scale, raw_scale, eps / raw_scale, beta, max_shift_for(q.dtype), tie_stride,
         drop_thr, drop_scale),
        dict(
            CAUSAL=causal, HAS_STAB=stab is not None, HAS_PROBE=has_probe,
            MASK_KIND=mask.kind, WHOLE_TILES=_whole_tiles(mask.kind, causal),
            EDGE_LOOP=_edge_loop("fwd", mask.kind, causal), EDGE_HOW=_edge_how("fwd"), DROPOUT=seed is not None,
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
            # computed here rather than by @triton.heuristics: its wrapper costs ~30 us of host time per launch
            EVEN_M=N % block_m == 0, EVEN_N=n_kv % block_n == 0, EVEN_D=D == head_dim,
            DOT_PRECISION=dot_precision(q.dtype), ASM=not INTERPRET,
            # the probe's warp-level statistics count a row once per warp: only where each row
            # lives in one warp (tensor-core tiles with the warps stacked along the rows)
            WARP_STATS=has_probe and not INTERPRET and q.dtype != torch.float32 and block_m >= 16 * cfg.num_warps,
            ORDERED=ordered, **cfg.options(),
        ),
    )
    if isinstance(mask, MaskArgs):
        mask.fill_flags()  # (read already where the forward's tile is made from them)
    return o, lse2


def _gluon_call(what: str, launch, q, k, v, do, *, masked: bool, dropout: bool = False,
                block: int = 64) -> Optional[str]:
    """Run ``launch(gluon_attention)`` (a Gluon kernel: the forward, or the backward's dQ or dK/dV)
    where it can serve the call; None if it did, else why not.

    A kernel that fails (a Triton whose Gluon differs, say) is reported once, on rank 0, and no
    Gluon kernel is tried again in this process: the Triton kernels serve instead."""
    if INTERPRET:
        return "Triton's interpreter"
    from instability_watch.kernels.attention import gluon as gluon_attention

    if not gluon_attention.available():
        return "this Triton has no Gluon for Hopper"
    why = gluon_attention.supported(q, k, v, do, masked=masked, dropout=dropout, block=block)
    if why is not None:
        return why
    try:
        if launch(gluon_attention):
            return None
        return "a tensor layout without a 2-D TMA view"
    except Exception as exc:  # noqa: BLE001 - any failure: the Triton kernels serve from now on
        reason = f"{type(exc).__name__}: {str(exc)[:200]}"
        gluon_attention.disable(f"failed once ({reason})")
        from instability_watch.ranks import rank

        if rank() == 0:
            warnings.warn(f"instability_watch: the Gluon {what} kernel (D = 256) failed ({reason}); "
                          "the Triton kernels serve every call from now on")
        return reason


def _gluon_dkdv(q, k, v, do, lse2, delta, dk, dv, causal, qk_scale, scale, mask_kind, seed) -> Optional[str]:
    """dK and dV by the Gluon kernel (gluon_attention.py); None if it served the call, else why not."""
    if not (lse2.is_contiguous() and delta.is_contiguous()):
        return "statistics not contiguous"
    return _gluon_call(
        "dK/dV", lambda ga: ga.dkdv(q, k, v, do, lse2, delta, dk, dv, causal=causal, qk_scale=qk_scale, scale=scale),
        q, k, v, do, masked=mask_kind != MASK_NONE, dropout=seed is not None)


def qk_scale_of(mask_kind: int, scale: float) -> float:
    """The scores' factor into log2 units in the backward kernels (1 with an additive mask, which scales itself)."""
    return 1.0 if mask_kind == MASK_ADD else scale * LOG2E


def attention_backward_lse2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse2: torch.Tensor, do: torch.Tensor, *,
    causal: bool, scale: float, counts: Optional[torch.Tensor], values: Optional[torch.Tensor], shadow: bool,
    config_dkdv=None, config_dq=None, delta: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
    mask_grad: bool = False, fused: Optional[bool] = None, config_fused=None,
    split: Optional[bool] = None, config_dk=None, config_dv=None, gluon: Optional[bool] = None,
    delta_hp: bool = False, documents: Optional[Documents] = None, dlse: Optional[torch.Tensor] = None,
    gqa_expand: Optional[bool] = None, mask_flags: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward. Two ways, with the same results up to float32 summation order.

    ``lse2`` is :func:`attention_forward_lse2`'s, in log2 units ((B, H, N) float32, or
    (2, B, H, N) with an additive mask); q, o, do (B, H, N, D), k, v (B, H_kv, N_kv, D),
    bfloat16/float16/float32; gradients in their inputs' dtype and layout. The two ways:

    * fused (FA2's): a pre-pass for delta = rowsum(dO * O), then one kernel per KV block that
      computes dK, dV and adds each query block's dQ into a float32 buffer with atomics;
    * two kernels: dQ (which computes delta, with the shadow statistics), then dK/dV.
      Bitwise deterministic.

    ``fused=None`` takes the fused way only where it is the faster one, calls with dropout at
    head dims up to 128 (it generates dropout's bits once instead of twice; without dropout, or
    at D = 256, the two kernels are faster on the H100: benchmarks/RESULTS.md), and never where
    the call needs what only the two kernels give: the shadow statistics (``shadow``), an
    additive mask's gradient (``mask_grad``), or determinism
    (``torch.use_deterministic_algorithms(True)``).
    The two kernels' dK/dV kernel runs in two passes (``split``: dK, then dV, each with one
    float32 accumulator) where the launch table has ``"dk"``/``"dv"`` entries (D = 256 on
    tensor cores, where two accumulators leave too few registers); ``split=True``/``False``
    forces it (a pass the table has no entry for takes the one-pass kernel's), ``config_dk``/
    ``config_dv`` override those passes' launch configurations (both ignored where the backward
    is fused or not split).
    ``gluon``: at D = 256 on an sm_90 GPU, the two kernels' dK/dV runs as one Gluon kernel
    (``gluon_attention.py``: one pass, 1.2 ms against the two Triton passes' 1.9 ms on the H100)
    where the call has no mask, dropout or GQA; ``None`` does so where it can and the dK/dV
    launch is not overridden, ``False`` never, ``True`` raises ValueError where it cannot (the
    dK/dV overrides ``split`` and ``config_dk*``/``config_dv`` then apply only to calls it cannot serve).
    dQ runs as a Gluon kernel too where it can (the same calls, N a multiple of 128, no shadow
    statistics or mask gradient) unless ``gluon=False``, or ``config_dq`` is given with ``gluon=None``;
    ``gluon=True`` does not require it (a call it cannot serve takes the Triton dQ kernel).
    ``delta`` (B, H, N) float32, if given, replaces ``rowsum(dO * O)``; ``delta_hp`` (the paper's
    control, not with ``delta``) replaces it with ``rowsum(dO * O_hp)``, ``O_hp = PV`` with ``P``
    unrounded in float32, from a pre-pass of the dQ kernel (``DELTA_HP_ONLY``: the scores and
    ``dO V^T`` again, about a forward's work). ``dlse`` (B, H, N), the gradient of the rows' natural-log
    log-sum-exp (0 on rows without keys), enters delta: ``dS = P * (dP - (delta - dlse))``; the dQ kernel
    subtracts it where it computes delta, and the shadow statistics still compare ``rowsum(dO * O)``.
    ``gqa_expand`` (grouped-query calls; None: :data:`GQA_EXPAND`): the dK/dV kernel runs a program per query
    head instead of per K/V head (H / H_kv times the programs, each 1 / (H / H_kv) of the work: for calls whose
    K/V tiles alone do not fill the GPU), its shares summed over each group afterwards in float32. ``mask_flags``:
    the forward's base tile flags of the mask (its ``mask_flags``; others are not used). Returns
    ``(dq, dk, dv, dmask)``; ``dmask`` (an additive mask's gradient, in its shape and
    dtype) only if ``mask_grad``, else None.
    """
    B, H, N, D = q.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    q, k, v, o, do = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, o, do))
    head_dim = head_dim_tile(D)
    precision = dot_precision(q.dtype)
    if delta_hp and delta is not None:
        raise ValueError("delta_hp=True computes delta itself: pass no delta with it")
    delta_from_o = delta is None and not delta_hp
    if dlse is not None:
        dlse = dlse.to(torch.float32).reshape(B, H, N).contiguous()
        if delta_from_o and D == 256 and gluon is not False:  # the Gluon dQ computes delta itself: here, then
            delta = (o.float() * do.float()).sum(dim=-1)
            delta_from_o = False
    if delta is None:
        delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    else:
        delta = delta.to(torch.float32).contiguous()
        if dlse is not None and not delta_hp:
            delta = delta - dlse  # a given delta (or the one just computed) takes the lse's share here
    dq, dk, dv = empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)
    mask = documents if documents is not None else MaskArgs(attn_mask, B, H, N, n_kv, mask_flags)
    mask_grad = mask_grad and mask.kind == MASK_ADD
    dmask = torch.zeros((B, H, N, n_kv), dtype=torch.float32, device=q.device) if mask_grad else None
    seed, drop_thr, drop_scale = _dropout_args(dropout_p, seed)
    if delta_hp:  # the control's delta, before anything reads it (same stream)
        cfg = launch_config(_entry("dq", mask.kind, head_dim, q.dtype), head_dim, q.dtype)
        ranges, r_strides = mask.rows(cfg.block_m, cfg.block_n) if mask.kind else (None, (0, 0, 0))
        grid, order, ordered = _launch_grid(cdiv(N, cfg.block_m), B * H, mask, ("rows", cfg.block_m, cfg.block_n),
                                            ranges)
        launch_dq(
            grid,
            (q, k, v, o, do, lse2, delta, dq, None, None, mask.tensor, ranges, order, seed, None, None),
            (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
             *mask.strides, *r_strides, H, H // h_kv, N, n_kv, D, B * H * N, qk_scale_of(mask.kind, scale), scale,
             drop_thr, drop_scale),
            dict(CAUSAL=causal, SHADOW=False, DELTA_FROM_O=False, MASK_KIND=mask.kind,
                 WHOLE_TILES=_whole_tiles(mask.kind, causal),
                 EDGE_LOOP=_edge_loop("dq", mask.kind, causal), EDGE_HOW=_edge_how("dq"),
                 DROPOUT=seed is not None,
                 MASK_GRAD=False, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 DOT_PRECISION=precision, DELTA_HP_ONLY=True, ORDERED=ordered, **cfg.options()),
        )
        if dlse is not None:
            delta.sub_(dlse)
    shadow = shadow and counts is not None
    if fused is None:
        fused = (seed is not None and head_dim <= 128 if FUSED_BACKWARD is None else FUSED_BACKWARD) and not (
            shadow or mask_grad or torch.are_deterministic_algorithms_enabled())
    elif fused and (shadow or mask_grad):
        raise ValueError("fused=True: the fused backward computes neither the shadow statistics nor a mask's gradient")
    if fused and gluon:
        raise ValueError("gluon=True with a fused backward: the Gluon kernel serves only the two-kernel backward's dK/dV")
    qk_scale = qk_scale_of(mask.kind, scale)

    expand = (GQA_EXPAND if gqa_expand is None else gqa_expand) and h_kv < H

    def dkdv(cfg: LaunchConfig, dq_acc: Optional[torch.Tensor], part: int = 0) -> None:
        """The dK/dV kernel; with ``dq_acc`` (B, H, N, D) float32, the fused backward's (dQ added there);
        ``part`` 1 or 2: dK or dV alone. With ``expand`` (GQA): a program per query head, its dK/dV shares in
        float32 (B, H, N_kv, D) buffers summed over each group here."""
        ranges, r_strides = mask.cols(cfg.block_n, cfg.block_m) if mask.kind else (None, (0, 0, 0))
        heads, kv_div, out_k, out_v = h_kv, 1, dk, dv
        if expand:  # (a pass that computes only one of them leaves the other buffer unwritten: one serves both)
            heads, kv_div = H, H // h_kv
            out_k = out_v = torch.empty((B, H, n_kv, D), dtype=torch.float32, device=q.device)
            if part == 0:
                out_v = torch.empty_like(out_k)
        grid, order, ordered = _launch_grid(cdiv(n_kv, cfg.block_n), B * heads, mask,
                                            ("cols", cfg.block_n, cfg.block_m), ranges)
        launch_dkdv(
            grid,
            (q, k, v, do, lse2, delta, out_k, out_v, dq_acc, mask.tensor, ranges, order, seed),
            (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *out_k.stride()[:3],
             *out_v.stride()[:3], *mask.strides, *r_strides, H, heads, kv_div,
             N, n_kv, D, B * H * N, qk_scale, scale, drop_thr, drop_scale),
            dict(CAUSAL=causal, MASK_KIND=mask.kind, WHOLE_TILES=_whole_tiles(mask.kind, causal),
                 EDGE_LOOP=_edge_loop("dkdv", mask.kind, causal), EDGE_HOW=_edge_how("dkdv"),
                 DROPOUT=seed is not None, FUSED_DQ=dq_acc is not None,
                 HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION=precision,
                 PART=part, ORDERED=ordered, EVEN_MD=EVEN_LOADS and N % cfg.block_m == 0 and D == head_dim,
                 **cfg.options()),
        )
        if expand:
            for want, out, grad in ((part != 2, out_k, dk), (part != 1, out_v, dv)):
                if want:
                    grad.copy_(out.view(B, h_kv, H // h_kv, n_kv, D).sum(dim=2))

    if fused:
        if delta_from_o:
            bm = 16 if INTERPRET else (64 if head_dim <= 128 else 32)
            launch_delta(
                (cdiv(N, bm), B * H), (o, do, delta),
                (*o.stride()[:3], *do.stride()[:3], H, N, D),
                dict(HEAD_DIM=head_dim, BLOCK_M=bm, num_warps=4, num_stages=1),
            )
            if dlse is not None:
                delta.sub_(dlse)
        dq_acc = torch.zeros((B, H, N, D), dtype=torch.float32, device=q.device)
        dkdv(launch_config("fused", head_dim, q.dtype, override=config_fused), dq_acc)
        dq.copy_(dq_acc)
        return dq, dk, dv, None
    # dQ first: its programs write delta, which every dK/dV program reads
    why_dq = "off"
    if gluon is not False and (gluon or config_dq is None) and D == 256:  # the Gluon kernel, where it can
        why_dq = "shadow statistics, a mask's gradient or statistics not contiguous"
        if not (shadow or mask_grad) and lse2.is_contiguous():
            why_dq = _gluon_call(
                "dQ", lambda ga: ga.dq(q, k, v, o, do, lse2, delta, dq, causal=causal, qk_scale=qk_scale, scale=scale,
                                       delta_from_o=delta_from_o),
                q, k, v, do, masked=mask.kind != MASK_NONE, dropout=seed is not None, block=128)
    if why_dq is not None:  # the Triton kernel (also the shadow statistics, a mask's gradient)
        cfg = launch_config(_entry("dq", mask.kind, head_dim, q.dtype), head_dim, q.dtype, override=config_dq)
        block_m, block_n = cfg.block_m, cfg.block_n
        ranges, r_strides = mask.rows(block_m, block_n) if mask.kind else (None, (0, 0, 0))
        grid, order, ordered = _launch_grid(cdiv(N, block_m), B * H, mask, ("rows", block_m, block_n), ranges)
        launch_dq(
            grid,
            (q, k, v, o, do, lse2, delta, dq, counts, values, mask.tensor, ranges, order, seed, dmask, dlse),
            (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
             *mask.strides, *r_strides, H, H // h_kv, N, n_kv, D, B * H * N, qk_scale, scale, drop_thr, drop_scale),
            dict(CAUSAL=causal, SHADOW=shadow, DELTA_FROM_O=delta_from_o, MASK_KIND=mask.kind,
                 WHOLE_TILES=_whole_tiles(mask.kind, causal),
                 EDGE_LOOP=_edge_loop("dq", mask.kind, causal), EDGE_HOW=_edge_how("dq"),
                 DROPOUT=seed is not None,
                 MASK_GRAD=mask_grad, HEAD_DIM=head_dim, BLOCK_M=block_m,
                 BLOCK_N=block_n, DOT_PRECISION=precision, HAS_DLSE=dlse is not None, ORDERED=ordered,
                 EVEN_ND=EVEN_LOADS and EVEN_DQ and n_kv % block_n == 0 and D == head_dim, **cfg.options()),
        )
    want = gluon
    if want is None:
        want = split is None and config_dkdv is None and config_dk is None and config_dv is None and D == 256
    if want:
        why = _gluon_dkdv(q, k, v, do, lse2, delta, dk, dv, causal, qk_scale, scale, mask.kind, seed)
        if why is None:
            return dq, dk, dv, None  # served calls have no mask, so no mask gradient
        if gluon:
            raise ValueError(f"gluon=True: the Gluon dK/dV kernel cannot serve this call ({why})")
    if split is None:
        split = config_dkdv is None and all(has_launch_config(p, head_dim, q.dtype) for p in ("dk", "dv"))
    if split:
        for part, (kernel, override) in enumerate((("dk", config_dk), ("dv", config_dv)), start=1):
            if override is None and not has_launch_config(kernel, head_dim, q.dtype):
                kernel, override = "dkdv", config_dkdv  # split=True where the table has no pass of its own
            dkdv(launch_config(kernel, head_dim, q.dtype, override=override), None, part=part)
    else:
        dkdv(launch_config(_entry("dkdv", mask.kind, head_dim, q.dtype), head_dim, q.dtype, override=config_dkdv),
             None)
    if dmask is not None:
        dmask = reduce_to(dmask, attn_mask.shape).to(attn_mask.dtype)
    return dq, dk, dv, dmask
