"""``nn.MultiheadAttention``'s SDPA call, and ``Tensor.unflatten`` in compiled code: two torch functions the observer's
mode (:mod:`~instability_watch.observe.sdpa`) meets that need more than passing them on.

``F.multi_head_attention_forward`` is a torch function of its own: the mode sees it first, and while the mode's
handler runs the mode is off, so the SDPA call inside it would pass unseen. In eager code the handler runs instead
a copy of that function (the same code, the globals of ``torch.nn.functional`` as they are at the call) whose
torch-function check answers False, so the copy does not come back to the handler, and whose
``scaled_dot_product_attention`` makes the call (PyTorch's, or what the user put in its place) with the mode on
again: the observer sees it like any other SDPA call. Nothing of PyTorch's is changed. Under ``torch.compile``
(Dynamo ties a function's globals to its module, so the copy cannot be traced) and with ``need_weights=True``
(the attention is then computed without SDPA) the call is counted unobserved, with its reason.
"""
from __future__ import annotations

import inspect
import sys
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F

from instability_watch.observe.coverage import NOT_APPLIED, UNOBSERVED

MHA_FORWARD = F.multi_head_attention_forward
MHA_COMPILED = ("nn.MultiheadAttention under torch.compile: its SDPA call, inside F.multi_head_attention_forward, "
                "cannot be reached in compiled code (it is observed in eager code)")
MHA_WEIGHTS = ("nn.MultiheadAttention called with need_weights=True (its default) computes the attention without "
               "SDPA: call it with need_weights=False (as nn.TransformerEncoderLayer does) to have it observed")
MHA_REASONS = (MHA_COMPILED, MHA_WEIGHTS)
"""The reasons an ``nn.MultiheadAttention`` call is located but not observed."""

_NEED_WEIGHTS = list(inspect.signature(MHA_FORWARD).parameters).index("need_weights")


def mha_call(observer: Any, func: Callable, args, kwargs):
    """An ``nn.MultiheadAttention`` call met by ``observer``'s mode (an
    :class:`~instability_watch.observe.sdpa.SdpaObserver`): its SDPA call observed (and routed) like any other, or
    the reason it cannot be counted."""
    if not (observer.stats or observer.shadow or observer.route):
        return func(*args, **kwargs)
    compiling = torch.compiler.is_compiling()
    why = MHA_COMPILED if compiling else MHA_WEIGHTS if _need_weights(args, kwargs) else None
    if why is not None:
        if not compiling:
            observer.sdpa_calls += 1  # an attention call met, its reason counted (not "no attention call" too)
        if observer.route:
            observer.count(NOT_APPLIED, why)
        if observer.stats or observer.shadow:
            observer.count(UNOBSERVED, why)
        return func(*args, **kwargs)
    if observer.mha_forward is None:
        observer.mha_forward = _copy_for(observer)
    _refresh(observer.mha_forward)
    return observer.mha_forward(*args, **kwargs)


def _need_weights(args, kwargs) -> bool:
    if "need_weights" in kwargs:
        return bool(kwargs["need_weights"])
    return bool(args[_NEED_WEIGHTS]) if len(args) > _NEED_WEIGHTS else True


def _no_torch_function(*_) -> bool:
    return False


def _copy_for(observer: Any) -> Callable:
    """``F.multi_head_attention_forward``'s code for ``observer``'s layer, with torch.nn.functional's globals but
    two: ``has_torch_function`` answers False (the copy does not come back to the handler), and
    ``scaled_dot_product_attention`` makes the SDPA call (PyTorch's, or what the user put in its place) with the
    observer's mode on, so the observer sees it like any other."""
    f = MHA_FORWARD
    copy = types.FunctionType(f.__code__, {}, f.__name__, f.__defaults__, f.__closure__)
    copy.__kwdefaults__ = f.__kwdefaults__
    names = copy.__globals__

    def sdpa(*args, **kwargs):
        with observer:
            return names["_user_sdpa"](*args, **kwargs)

    names["_observer_sdpa"] = sdpa
    _refresh(copy)
    return copy


def _refresh(copy: Callable) -> None:
    """The copy's globals as torch.nn.functional's are now (a name the user replaced there is replaced for the
    copy too)."""
    names = copy.__globals__
    sdpa = names["_observer_sdpa"]
    names.update(vars(sys.modules[MHA_FORWARD.__module__]))
    names["_user_sdpa"] = names["scaled_dot_product_attention"]
    names["has_torch_function"] = _no_torch_function
    names["scaled_dot_product_attention"] = sdpa
    names["_observer_sdpa"] = sdpa


# ----------------------------------------------------------------------------- Tensor.unflatten, compiled

TENSOR_UNFLATTEN = torch.Tensor.unflatten


def unflatten(func: Callable, args, kwargs):
    """``Tensor.unflatten`` reached through the mode in compiled code: Dynamo cannot trace that method's
    ``super().unflatten`` (a layer doing ``x.unflatten(...)`` would fail under fullgraph, else break the graph), so
    the same op, ``torch.unflatten``; a named shape goes to the method."""
    try:
        t, dim, sizes = _unflatten_args(*args, **kwargs)
    except TypeError:
        return func(*args, **kwargs)
    if isinstance(sizes, dict) or (isinstance(sizes, (tuple, list)) and sizes and isinstance(sizes[0], (tuple, list))):
        return func(*args, **kwargs)
    return torch.unflatten(t, dim, sizes)


def _unflatten_args(self, dim, sizes):
    return self, dim, sizes
