"""The kernels' fast launch path (kernels._launch.Launcher), with a stand-in for a Triton kernel.

On the GPU the same path is checked bitwise against Triton's own launch
(test_triton_gpu.py::test_fast_launch_matches_tritons_launch).
"""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from instability_watch.kernels import launch as launching  # noqa: E402


class FakeKernel:
    """Records launches through ``fn[grid](...)`` and through the compiled launcher."""

    def __init__(self, launcher_ok=True):
        self.params = [SimpleNamespace(name=n, is_constexpr=c) for n, c in
                       (("X", False), ("Y", False), ("n", False), ("scale", False), ("BLOCK", True), ("FLAG", True))]
        self.triton_calls = []
        self.fast_calls = []
        self.compiled = 0
        self.launcher_ok = launcher_ok

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.triton_calls.append((grid, args, meta))
            self.compiled += 1
            launcher = SimpleNamespace(global_scratch_size=0, profile_scratch_size=0,
                                       launch_cooperative_grid=False, launch_pdl=False)
            if self.launcher_ok:
                launcher.launch = lambda *a: self.fast_calls.append(a)
            return SimpleNamespace(run=launcher, function=1000 + self.compiled, packed_metadata=(4, 1, 0))
        return run


class Launcher(launching.Launcher):
    enabled = True

    def _bind_driver(self):
        self._device = lambda: 0
        self._stream = lambda device: 77


def _launch(launcher, x, y, n=64, scale=0.5, block=16):
    launcher((3, 2), (x, y), (n, scale), dict(BLOCK=block, FLAG=True, num_warps=4))


def test_second_launch_calls_the_compiled_launcher_with_addresses():
    fn = FakeKernel()
    launcher = Launcher(fn)
    x, y = torch.zeros(64), torch.ones(64)
    _launch(launcher, x, y)
    assert len(fn.triton_calls) == 1 and not fn.fast_calls
    _launch(launcher, x, y)
    assert len(fn.triton_calls) == 1 and len(fn.fast_calls) == 1
    args = fn.fast_calls[0]
    # grid, stream, function, cooperative, pdl, scratch x2, metadata, launch metadata, hooks x2, then the arguments
    assert args[:3] == (3, 2, 1) and args[3] == 77 and args[4] == 1001
    assert args[9] == (4, 1, 0) and args[10:13] == (None, None, None)
    assert args[13:] == (x.data_ptr(), y.data_ptr(), 64, 0.5, 16, True)


@pytest.mark.parametrize("grid", [(5,), (3, 2), (3, 2, 4)])
def test_the_fast_launch_passes_every_axis_of_the_grid(grid):
    """One, two and three grid axes reach the compiled launcher as (x, y, z), the missing ones 1 (a 3-D grid's z
    axis dropped would run its first plane only)."""
    fn = FakeKernel()
    launcher = Launcher(fn)
    x, y = torch.zeros(64), torch.ones(64)
    for _ in range(2):
        launcher(grid, (x, y), (64, 0.5), dict(BLOCK=16, FLAG=True, num_warps=4))
    assert fn.triton_calls[0][0] == grid and len(fn.fast_calls) == 1
    assert fn.fast_calls[0][:3] == tuple(grid) + (1,) * (3 - len(grid))


@pytest.mark.parametrize(
    "change",
    ["misaligned", "dtype", "int_value", "constexpr", "option"],
)
def test_anything_triton_specializes_on_takes_tritons_path(change):
    fn = FakeKernel()
    launcher = Launcher(fn)
    buf = torch.zeros(80)
    x, y = buf[:64], torch.ones(64)
    _launch(launcher, x, y)
    if change == "misaligned":  # 4 bytes off a 16-byte boundary
        _launch(launcher, buf[1:65], y)
    elif change == "dtype":
        _launch(launcher, x.double(), y)
    elif change == "int_value":  # 64 % 16 == 0, 65 is not
        _launch(launcher, x, y, n=65)
    elif change == "constexpr":
        _launch(launcher, x, y, block=32)
    else:
        launcher((3, 2), (x, y), (64, 0.5), dict(BLOCK=16, FLAG=True, num_warps=8))
    assert len(fn.triton_calls) == 2 and not fn.fast_calls


def test_none_pointers_and_launch_hooks():
    fn = FakeKernel()
    launcher = Launcher(fn)
    x = torch.zeros(64)
    _launch(launcher, x, None)
    _launch(launcher, x, None)
    assert fn.fast_calls[-1][13:15] == (x.data_ptr(), None)
    hooks = launching.triton.knobs.runtime.launch_enter_hook
    if hooks is None or not hasattr(hooks, "add"):
        pytest.skip("this Triton has no launch hook chain")
    hook = lambda metadata: None  # what a profiler installs: it must see every launch
    hooks.add(hook)
    try:
        _launch(launcher, x, None)
    finally:
        hooks.remove(hook)
    assert len(fn.triton_calls) == 2 and len(fn.fast_calls) == 1


def test_unknown_launchers_and_failing_launches_fall_back_to_triton():
    fn = FakeKernel(launcher_ok=False)
    launcher = Launcher(fn)
    x = torch.zeros(64)
    for _ in range(3):
        _launch(launcher, x, x)
    assert len(fn.triton_calls) == 3 and not fn.fast_calls

    class Failing(Launcher):
        enabled = True

    fn = FakeKernel()
    launcher = Failing(fn)
    _launch(launcher, x, x)
    key = next(iter(launcher.cache))
    entry = list(launcher.cache[key])
    entry[0] = lambda *a: (_ for _ in ()).throw(TypeError("arguments"))
    launcher.cache[key] = tuple(entry)
    with pytest.warns(UserWarning, match="fast kernel launch failed"):
        _launch(launcher, x, x)  # the launcher raises: Triton's path, and from then on only that
    _launch(launcher, x, x)
    assert len(fn.triton_calls) == 3 and not fn.fast_calls and Failing.enabled is False
    assert Launcher.enabled is True and launching.Launcher.enabled in (True, False)


def test_off_in_the_interpreter_and_on_request(monkeypatch):
    monkeypatch.setattr(launching, "INTERPRET", True)
    assert not launching.fast_launch_enabled()
    monkeypatch.setattr(launching, "INTERPRET", False)
    monkeypatch.setattr(launching.triton, "__version__", "3.6.0")
    assert launching.fast_launch_enabled()
    monkeypatch.setenv("INSTABILITY_WATCH_FAST_LAUNCH", "0")
    assert not launching.fast_launch_enabled()
    monkeypatch.delenv("INSTABILITY_WATCH_FAST_LAUNCH")
    monkeypatch.setattr(launching.triton, "__version__", "3.9.0")
    assert not launching.fast_launch_enabled()


def test_a_tensor_on_another_device_takes_tritons_path():
    class OnDevice:  # what the launcher reads of a tensor
        def __init__(self, device):
            self.dtype, self.device = torch.bfloat16, device

        def data_ptr(self):
            return 1 << 20

        def get_device(self):
            return self.device

    fn = FakeKernel()
    launcher = Launcher(fn)
    for device in (0, 0, 1, -1):  # -1: the CPU
        _launch(launcher, OnDevice(device), OnDevice(0))
    assert len(fn.fast_calls) == 1 and len(fn.triton_calls) == 3
