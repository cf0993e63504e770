"""Observing flash-attn 4's functions: ``flash_attn.cute.flash_attn_func`` and ``flash_attn_varlen_func``.

They are Python functions over FA4's own autograd functions (``FlashAttnFunc``, ``FlashAttnVarlenFunc`` in
``flash_attn.cute.interface``), not torch functions: a layer's ``TorchFunctionMode`` does not see them. So while a
watched layer's forward runs under its observer (probe steps and switched layers; eager forwards), the ``apply`` of
those two autograd functions is a handler that hands each call to that observer (:func:`hook`, :func:`unhook`):
the observer is a context variable (each thread, and a watched module inside another, sees its own), and the
handler is installed while any watched forward runs and removed when the last one ends. Between probe steps
nothing of the watch is on FA4's path, however the user imported its functions.
The watch never imports FA4: a process that has not imported ``flash_attn.cute`` has no calls to hook.

A call is read by its arguments' names (FA4's ``forward`` signature, read once per class) and seen as a packed
call (:class:`~instability_watch.kernels.stats.varlen.VarlenCall`): a varlen call by its ``cu_seqlens_q`` and
``cu_seqlens_k``, a batched call ``(B, S, H, D)`` as ``B`` documents of ``S`` rows; ``causal`` and
``window_size`` bottom-right aligned within a document and read as FA4 reads them (:func:`_window`). Its
statistics and shadow pass are the packed call's, on the call's own O. A call with an argument the statistics
cannot reproduce (``softcap``, ``score_mod``, ``mask_mod``, ``learnable_sink``, ``qv``, paged or gathered keys,
a window with one negative side, ...) is counted unobserved with that argument's name. A switched layer's calls
run on our kernels over the same documents (:func:`~instability_watch.flash_attention_varlen`) and return what
FA4 returns, ``(out, lse)``.

Not observed: FA4 inside a forward compiled by ``torch.compile`` (Dynamo traces the call, not the hook; the
watch says so at the first probe step when its compiled forwards made no call it sees), and
flash-attn 2 and 3 (``flash_attn``, ``flash_attn_interface``), which never ran here.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from instability_watch.kernels.attention.ops import KEEP_DOCUMENTS
from instability_watch.kernels.stats.varlen import VarlenCall, varlen_stats
from instability_watch.observe.coverage import NOT_APPLIED, UNOBSERVED
from instability_watch.observe.sdpa import VarlenShadowTap, follow_device
from instability_watch.probe.fields import COUNT_ROW

INTERFACE = "flash_attn.cute.interface"
FUNCTIONS = {"FlashAttnFunc": "flash_attn_func", "FlashAttnVarlenFunc": "flash_attn_varlen_func"}
# arguments the statistics read; arguments that change nothing they read (how the work is split, what is returned)
_READ = frozenset({"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "softmax_scale", "causal", "window_size"})
_NEUTRAL = frozenset({"max_seqlen_q", "max_seqlen_k", "num_splits", "pack_gqa", "deterministic", "return_lse",
                      "scheduler_metadata", "seqlen_k_per_split", "disable_scheduler_metadata", "score_mod_bwd",
                      "block_sparse_tensors_bwd", "gather_bwd_recompute_p", "gather_bwd_token_chunk",
                      "min_seqlen_k"})
_SIGNATURES: Dict[type, Tuple[Tuple[str, ...], Dict[str, object]]] = {}
_BOUNDS: Dict[tuple, Tuple[Tensor, Tensor]] = {}  # a batched call's documents' boundaries, one pair per shape


@dataclass
class FlashAttnCall:
    """One FA4 call as the statistics read it: ``packed``, the call as packed documents (None where unreadable,
    with ``why``), ``batch`` the ``(B, S_q)`` of a batched call (None: a varlen one)."""

    function: str
    packed: Optional[VarlenCall]
    batch: Optional[Tuple[int, int]]
    return_lse: bool
    why: Optional[str]

    @classmethod
    def parse(cls, function: str, signature, args, kwargs, num_heads: int) -> "FlashAttnCall":
        """The call of ``function`` (``signature``: its autograd function's argument names and defaults) as a
        layer of ``num_heads`` heads sees it; ``why`` names what the statistics cannot read."""
        names, defaults = signature
        got = dict(zip(names, args))
        got.update(kwargs)
        # FA4 returns its log-sum-exp when asked, or when an input requires grad (None otherwise)
        return_lse = bool(got.get("return_lse", False)) or any(
            isinstance(got.get(n), Tensor) and got[n].requires_grad for n in ("q", "k", "v"))

        def refused(why: str) -> "FlashAttnCall":
            return cls(function, None, None, return_lse, f"{function}: {why}")

        if not _READ - {"cu_seqlens_q", "cu_seqlens_k"} <= set(names) or len(args) > len(names):
            return refused("arguments this version of the watch does not know (flash_attn.cute's signature)")
        for name, value in got.items():
            if name not in _READ and name not in _NEUTRAL and not _at_default(value, defaults.get(name)):
                return refused(f"{name} (the statistics cannot reproduce it)")
        q, k, v = got.get("q"), got.get("k"), got.get("v")
        if not all(isinstance(t, Tensor) for t in (q, k, v)):
            return refused("inputs are not tensors")
        if k is v and v.shape[-1] == 512:
            return refused("k is v with a head dim of 512 (FA4's MLA form)")
        window = _window(bool(got.get("causal", False)), got.get("window_size"))
        if window is None:
            return refused(f"window_size {got.get('window_size')!r} (one side negative: FA4 takes it as a bound)")
        scale = got.get("softmax_scale")
        cu_q, cu_k = got.get("cu_seqlens_q"), got.get("cu_seqlens_k")
        if cu_q is None and cu_k is None:
            if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[0] != q.shape[0] or v.shape[:2] != k.shape[:2]:
                return refused(f"inputs not (B, S, H, D) alike: q {tuple(q.shape)}, k {tuple(k.shape)}")
            (b, s_q), s_k = q.shape[:2], k.shape[1]
            cu_q, cu_k = _batch_bounds(b, s_q, s_k, q.device)
            q, k, v = (t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v))
            batch = (b, s_q)
        elif not (isinstance(cu_q, Tensor) and isinstance(cu_k, Tensor)):
            return refused("cu_seqlens_q without cu_seqlens_k (or the other way)")
        else:
            batch = None
        causal = window[1] == 0 and window[0] < 0
        packed = VarlenCall(q, k, v, cu_q, cu_k, causal, scale, window, False)
        why = packed.unobservable(num_heads)
        return cls(function, packed, batch, return_lse, None if why is None else f"{function}: {why}")

    def outputs(self, o: Tensor, lse: Optional[Tensor]):
        """FA4's outputs ``(out, lse)`` from the packed call's ``o (T_q, H, D_v)`` and ``lse (H, T_q)``: a row that
        sees no key has ``lse = -inf``, as FA4's (our kernels give +inf)."""
        if lse is not None:
            lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
        if self.batch is None:
            return o, lse
        b, s = self.batch
        out = o.reshape(b, s, *o.shape[1:])
        return out, None if lse is None else lse.reshape(lse.shape[0], b, s).permute(1, 0, 2).contiguous()

    def flat(self, out: Tensor) -> Tensor:
        """FA4's ``out`` as the packed call's ``o (T_q, H, D_v)``."""
        return out if self.batch is None else out.reshape(-1, *out.shape[2:])


def _at_default(value, default) -> bool:
    if value is None or value is default:
        return True
    if isinstance(value, (tuple, list)) and not value and default is None:
        return True  # aux_tensors=[], aux_scalars=(): FA4 reads them as None
    if isinstance(value, bool) or isinstance(default, bool):
        return value is False and default in (False, None)
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value == default
    return False


def _window(causal: bool, window_size) -> Optional[Tuple[int, int]]:
    """FA4's ``causal`` and ``window_size = (left, right)`` as the packed call's ``(left, right)`` (-1: unbounded),
    read as FA4 reads them: a side is unbounded when it is None, or when both are negative; ``causal`` sets
    ``right = 0``. None where FA4 would take a negative side as a bound (a window the statistics do not model)."""
    if window_size is None:
        window_size = (None, None)
    try:
        left, right = (None if w is None else int(w) for w in window_size)
    except (TypeError, ValueError):
        return None
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if (left is not None and left < 0) or (right is not None and right < 0):
        return None
    return (-1 if left is None else left, -1 if right is None else right)


def _batch_bounds(b: int, s_q: int, s_k: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """The boundaries of a batched call's ``b`` documents, kept per shape: the same tensors for a step's layers
    (the documents found for them are kept for the step, as a packed batch's)."""
    key = (b, s_q, s_k, device)
    hit = _BOUNDS.get(key)
    if hit is None:
        if len(_BOUNDS) >= 64:
            _BOUNDS.clear()
        hit = tuple(torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device) for s in (s_q, s_k))
        _BOUNDS[key] = hit
    return hit


def _signature(cls: type) -> Tuple[Tuple[str, ...], Dict[str, object]]:
    hit = _SIGNATURES.get(cls)
    if hit is None:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # after ctx
        hit = (tuple(p.name for p in params), {p.name: p.default for p in params})
        _SIGNATURES[cls] = hit
    return hit


_OBSERVER: contextvars.ContextVar = contextvars.ContextVar("instability_watch_fa4", default=None)
_LOCK = threading.Lock()
_INSTALLED: List[tuple] = []  # (class, what its __dict__ held under "apply") while any watched forward runs
_HANDLERS: Dict[type, object] = {}  # one handler per class, made once (the same object every probe step)
_USERS = [0]  # watched forwards running now, in every thread


def hook(observer) -> Optional[contextvars.Token]:
    """A watched layer's forward begins: FA4's calls in this context go to ``observer`` (:func:`observed_call`)
    until :func:`unhook` with what this returns; None where no FA4 is imported."""
    module = sys.modules.get(INTERFACE)
    if module is None:
        return None
    try:
        with _LOCK:
            if _USERS[0] == 0:
                try:
                    _install(module)
                except Exception:
                    _restore()
                    raise
            _USERS[0] += 1
    except Exception as exc:  # noqa: BLE001 - fail open: FA4 as it was, the failure reported
        if observer.on_error is None:
            raise
        observer.on_error("statistics", exc)
        return None
    return _OBSERVER.set(observer)


def unhook(token: contextvars.Token) -> None:
    """The forward that :func:`hook` returned ``token`` for has ended: its observer no longer takes FA4's calls,
    and FA4's autograd functions are as they were once no watched forward runs."""
    _OBSERVER.reset(token)
    with _LOCK:
        _USERS[0] -= 1
        if _USERS[0] == 0:
            _restore()


def _restore() -> None:
    for cls, before in reversed(_INSTALLED):
        if before is None:
            del cls.apply
        else:
            cls.apply = before
    _INSTALLED.clear()


def _install(module) -> None:
    for name, function in FUNCTIONS.items():
        cls = getattr(module, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
            continue
        before = cls.__dict__.get("apply")
        handler = _HANDLERS.get(cls)
        if handler is None:
            handler = staticmethod(functools.partial(_dispatch, cls.apply, function, _signature(cls)))
            _HANDLERS[cls] = handler
        _INSTALLED.append((cls, before))
        cls.apply = handler


def _dispatch(apply, function: str, signature, *args, **kwargs):
    observer = _OBSERVER.get()
    if observer is None:  # another thread's call, or one after its forward ended
        return apply(*args, **kwargs)
    return observed_call(observer, apply, function, signature, *args, **kwargs)


def observed_call(observer, apply, function: str, signature, *args, **kwargs):
    """One FA4 call in a watched layer's forward: run as the user called it (or on our kernels in a switched
    layer); on probe steps its statistics, on shadow steps its shadow tap; what cannot be done counted with its
    reason."""
    if torch.compiler.is_compiling():
        return apply(*args, **kwargs)
    observer.sdpa_calls += 1
    watching = observer.stats or observer.shadow
    if not (watching or observer.route):
        return apply(*args, **kwargs)
    try:
        call = FlashAttnCall.parse(function, signature, args, kwargs, observer.num_heads)
        why = call.why
        if why is None:
            why = follow_device(observer.group, call.packed.q.device)
    except Exception as exc:  # noqa: BLE001 - fail open: the user's call as they made it
        if observer.on_error is None:
            raise
        observer.on_error("statistics", exc)
        return apply(*args, **kwargs)
    out = None
    if observer.route:
        if why is not None:
            observer.count(NOT_APPLIED, why)
        else:
            routed = observer.varlen_routed(call.packed)
            if routed is not None:
                out = call.outputs(routed[0], routed[1] if call.return_lse else None)
    if out is None:
        out = apply(*args, **kwargs)  # the user's call, exactly as without the watch
    if why is not None:
        if watching:
            observer.count(UNOBSERVED, why)
        return out
    return _watch(observer, call, out)


def _watch(observer, call: FlashAttnCall, out):
    packed = call.packed
    o = call.flat(out[0])
    token = KEEP_DOCUMENTS.set(True)  # the documents kept for the step's other layers (forgotten at every step)
    try:
        if observer.stats:
            varlen_stats(packed, o.detach(), observer.counts, observer.values, eps=observer.eps)
            observer.counts[COUNT_ROW["observed_calls"]] += 1
        if observer.shadow and o.requires_grad:
            on_error = None if observer.on_error is None else functools.partial(observer.on_error, "statistics")
            tapped = VarlenShadowTap.apply(o, packed.q.detach(), packed.k.detach(), packed.v.detach(),
                                           packed.cu_seq_q, packed.cu_seq_k, packed.is_causal, packed.scale,
                                           packed.window, observer.counts, observer.values, on_error, True)
            out = (tapped.view(out[0].shape), *out[1:])
    except Exception as exc:  # noqa: BLE001 - fail open: the user's output stands
        if observer.on_error is None:
            raise
        observer.on_error("statistics", exc)
    finally:
        KEEP_DOCUMENTS.reset(token)
    return out
