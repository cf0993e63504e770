"""How the Triton kernels are launched, and the Triton versions this depends on.

Triton version pins, in one place:

* The fast launch path below (:class:`Launcher`) calls a compiled kernel's launcher
  directly, with arguments laid out as Triton's own ``fn[grid](...)`` lays them out.
  That layout is Triton-internal, so the path is used only on the versions it was
  checked against, :data:`FAST_LAUNCH_VERSIONS`: Triton 3.6, what the GPU machines run
  (torch 2.11 + triton 3.6); ``tests/kernels/test_triton_gpu.py::test_fast_launch_matches_tritons_launch``
  checks it bit for bit against Triton's path there. On every other version, in
  Triton's interpreter, with launch hooks installed (profilers), or with
  ``INSTABILITY_WATCH_FAST_LAUNCH=0``, every launch takes Triton's own path: slower on
  the host, the same results.
* The package itself takes any ``triton>=3.0`` (``pyproject.toml``'s dependencies).
* The ``test`` extra pins ``triton==3.9.0``: the CPU tests run the kernels through
  Triton's interpreter with a BF16 shim (``tests/triton_interp_bf16.py``) that touches
  the interpreter's private internals and was written for that version. The
  interpreter never takes the fast path, so the two pins do not meet: the CPU tests
  check the kernels' numerics on 3.9, the GPU tests the kernels and the fast path on 3.6.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton

from instability_watch.kernels import interpreting

# Triton decides at import whether @triton.jit kernels run in its interpreter, so the
# launchers read the flag once too (an environment lookup per launch is host time).
INTERPRET = interpreting()

# Triton versions the fast launch path was checked against (prefixes of triton.__version__).
FAST_LAUNCH_VERSIONS = ("3.6.",)
_FAST_CACHE_MAX = 256  # keys per kernel; beyond that (shapes that never repeat), cleared


def fast_launch_enabled() -> bool:
    """Whether :class:`Launcher` may take the fast path: compiled kernels on a Triton of
    :data:`FAST_LAUNCH_VERSIONS`, unless ``INSTABILITY_WATCH_FAST_LAUNCH=0``."""
    return (
        not INTERPRET
        and triton.__version__.startswith(FAST_LAUNCH_VERSIONS)
        and os.environ.get("INSTABILITY_WATCH_FAST_LAUNCH", "1") != "0"
    )


# Plain-Python helpers for the launch arguments: triton.cdiv is a constexpr function that
# costs ~1.5 us of host time per call.
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints: the number of tiles of ``b`` that cover ``a`` (an int)."""
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype``: ``"ieee"`` for float32 (exact
    float32 products, not TF32: the reference has no rounding there), else ``"tf32"`` (unused
    by bf16/fp16 dots)."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ``fn[grid](*args, **meta)`` costs 50-70 us of host time per launch on the lent GPU
# machines' CPUs (Triton's argument binding and cache key, launch hooks, and a CUDA driver
# call per tensor to check its pointer), more than a small attention call's GPU time.
# After a kernel's first launch for a specialization, later launches with an equal key
# call its compiled launcher directly, with the tensors' addresses as integers. The key is
# finer than Triton's: every integer argument's value (Triton specializes integers on ==1,
# %16 and their width), every tensor's dtype, 16-byte alignment and device, the current
# device, and the constexprs and launch options.


class Launcher:
    """``launcher(grid, tensors, scalars, meta, descs)`` runs ``fn[grid](*descs, *tensors, *scalars, **meta)``.

    ``descs`` are the kernel's leading host-side TMA descriptors (the Gluon kernels'
    ``TensorDescriptor``; keyed by block shape, layout, and their base's dtype, 16-byte
    alignment and device: their shapes and strides are run-time values, passed to the
    launcher, which encodes each once per launch as Triton's own path does), ``tensors``
    the pointer arguments after them (CUDA tensors of any dtype and shape, or None),
    ``scalars`` the integer and float arguments after those, ``meta`` the constexprs and
    launch options (the constexprs are the kernel's last parameters).
    ``enabled`` (a class attribute, :func:`fast_launch_enabled` at import) turns the fast
    path on; a fast launch that fails turns it off for every launcher, with a warning.
    """

    enabled = fast_launch_enabled()

    def __init__(self, fn):
        self.fn = fn
        self.cache = {}
        self._device = self._stream = None

    def __call__(self, grid, tensors, scalars, meta, descs=()):
        if not self.enabled:
            self.fn[grid](*descs, *tensors, *scalars, **meta)
            return
        ptrs = []
        key = [tuple(meta.values())]
        for d in descs:
            base = d.base
            key.append((tuple(d.block_shape), d.layout, base.dtype, base.data_ptr() % 16 == 0, base.get_device()))
        for t in tensors:
            if t is None:
                ptrs.append(None)
                key.append(None)
            else:
                p = t.data_ptr()
                ptrs.append(p)
                key.append(t.dtype)
                key.append(p % 16 == 0)
                key.append(t.get_device())  # a tensor on another device (or the CPU): Triton's path and checks
        if self._device is None:
            self._bind_driver()
        device = self._device()
        key.append(device)
        key.extend(scalars)
        key = tuple(key)
        entry = self.cache.get(key)
        if entry is not None and self._hooks_empty():
            launch, coop, pdl, function, packed, tail = entry
            try:
                launch(*grid, *(1,) * (3 - len(grid)), self._stream(device), function, coop, pdl, None, None, packed,
                       None, None, None, *descs, *ptrs, *scalars, *tail)
                return
            except Exception as exc:  # a launcher that does not take these arguments: Triton's path from now on
                type(self).enabled = False
                self.cache.clear()
                warnings.warn(f"instability_watch: fast kernel launch failed ({exc!r}); using Triton's launch path")
        compiled = self.fn[grid](*descs, *tensors, *scalars, **meta)
        if entry is None:
            self._remember(key, compiled, meta)

    def _bind_driver(self):
        active = triton.runtime.driver.active
        self._device = active.get_current_device
        self._stream = active.get_current_stream

    @staticmethod
    def _hooks_empty() -> bool:
        enter, exit_ = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
        return (enter is None or not enter.calls) and (exit_ is None or not exit_.calls)

    def _remember(self, key, compiled, meta):
        run = getattr(compiled, "run", None)
        launch = getattr(run, "launch", None)
        if launch is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
            return  # a launcher this path does not know: Triton's own path every time
        if len(self.cache) >= _FAST_CACHE_MAX:
            self.cache.clear()
        # the constexprs, the kernel's last parameters: passed to the launcher, not read by it
        tail = tuple(meta.get(p.name) for p in self.fn.params if p.is_constexpr)
        self.cache[key] = (
            launch, run.launch_cooperative_grid, run.launch_pdl, compiled.function, compiled.packed_metadata, tail,
        )
