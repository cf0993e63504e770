"""Shared test helpers (imported by the test modules; tests/ is on sys.path under pytest)."""
import math
import os
import signal
import subprocess
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]


def benchmark_module(name: str):
    """A module of ``benchmarks/`` (scripts that import each other by plain name), imported with that folder on
    the path for the import only."""
    import importlib

    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "benchmarks"))
        return importlib.import_module(name)
EXAMPLES = REPO / "examples"  # nanogpt.py and byte_corpus.py, imported by name


def run_process(cmd, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` as ``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)`` does, and
    kill what it started when it ends, fails or times out: nothing a test starts outlives it. Raises
    ``subprocess.TimeoutExpired`` as ``subprocess.run`` does.

    What it started is its process group and every process that carries its token in its environment:
    torchrun starts each rank in a session of its own, and a rank stuck in its teardown after the launcher
    returned is in neither the launcher's group nor its children. The output goes to files, not pipes, so a
    lingering rank that holds them cannot keep the call waiting."""
    import tempfile
    import uuid

    kwargs.pop("capture_output", None)
    kwargs.pop("text", None)
    token = uuid.uuid4().hex
    env = dict(kwargs.pop("env", None) or os.environ)
    env[_TOKEN] = token
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=out, stderr=err, text=True, env=env, **kwargs)
        try:
            proc.wait(timeout=timeout)
        finally:
            _kill_all(proc, token)
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


_TOKEN = "INSTABILITY_WATCH_TEST_PROCESS"


def _kill_all(proc: subprocess.Popen, token: str) -> None:
    """SIGKILL ``proc``'s process group and every process whose environment holds ``token`` (Linux's /proc)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    mark = f"{_TOKEN}={token}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def child_env(home, **extra) -> dict:
    """A clean environment for a process a test starts: the repository and ``examples/`` importable, offline
    (no model download), one thread; ``extra`` adds or replaces variables."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(EXAMPLES)]), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.update(extra)
    return env


def seeded(*key) -> torch.Generator:
    """A generator seeded from a test case's parameters: fresh inputs per case, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def sdpa_math(q, k, v, *, causal=False, scale=None):
    """PyTorch's own SDPA, math backend, computing in the inputs' dtype: the yardstick.

    By default PyTorch's math backend upcasts BF16/FP16 to float32 inside and
    rounds once at the end, which is not a BF16 computation; with
    ``allow_fp16_bf16_reduction_math_sdp(True)`` it computes in the inputs'
    dtype, like the PyTorch reference of flash-attention's own tests. For
    float32/float64 inputs the flag changes nothing.
    """
    flag = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(flag)


def run_fwd_bwd(fn, q, k, v, do, dtype):
    """Outputs and gradients of ``fn`` on inputs cast to ``dtype``: [o, dq, dk, dv]."""
    qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    o = fn(qq, kk, vv)
    o.backward(do.to(dtype))
    return [o.detach(), qq.grad, kk.grad, vv.grad]


def max_err(a, ref) -> float:
    return (a.double() - ref.double()).abs().max().item()


def ulp_bf16(x: float) -> float:
    """Spacing of bfloat16 numbers at magnitude x."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def assert_probe_counts_equal(probe, ref, names=("rows", "multi_max_rows", "tie_rows", "nonfinite_rows"),
                              rtol=1e-6) -> None:
    """Two probes' counters equal (``names``) and their maximum scores within ``rtol``: the Triton
    kernels against the reference, on the interpreter and on the GPU."""
    for name in names:
        assert getattr(probe, name).tolist() == getattr(ref, name).tolist(), name
    assert torch.allclose(probe.max_score, ref.max_score, rtol=rtol)


def fused_and_split_backward(q, k, v, do, *, causal, scale, tol, attn_mask=None, dropout_p=0.0, seed=None):
    """The Triton backward both ways (fused, dQ by atomics; two kernels) after one forward: the same
    gradients, in q's dtype and shape, finite, within ``tol`` of the largest. Returns the fused
    ``(dq, dk, dv)``."""
    from instability_watch.kernels.attention import triton as ta

    o, lse2 = ta.attention_forward_lse2(q, k, v, causal=causal, scale=scale, stabilize=None, beta=2.0, eps=1e-3,
                                        counts=None, values=None, attn_mask=attn_mask, dropout_p=dropout_p,
                                        seed=seed)
    kw = dict(causal=causal, scale=scale, counts=None, values=None, shadow=False, attn_mask=attn_mask,
              dropout_p=dropout_p, seed=seed)
    fused = ta.attention_backward_lse2(q, k, v, o, lse2, do, fused=True, **kw)
    split = ta.attention_backward_lse2(q, k, v, o, lse2, do, fused=False, **kw)
    assert fused[3] is None and split[3] is None
    for name, a, b in zip(("dq", "dk", "dv"), fused[:3], split[:3]):
        assert a.dtype == q.dtype and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        assert max_err(a, b) <= tol * max(b.abs().max().item(), 1e-6), (name, q.dtype, max_err(a, b))
    return fused[:3]


def count_document_searches(monkeypatch) -> list:
    """A list that gains an entry each time a packed batch's documents are found for the Triton kernels (a
    ``Documents`` made), for the rest of the test."""
    from instability_watch.kernels.attention import ops

    made = []
    real = ops._triton().Documents

    class Counted(real):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ops._triton(), "Documents", Counted)
    return made


def compiled_kernels(fn) -> int:
    """How many compiled variants a Triton kernel ``fn`` holds (``triton.heuristics`` wrappers unwrapped): a test
    that counts them before and after a change knows whether the change compiled anything."""
    while not hasattr(fn, "device_caches"):  # unwrap triton.heuristics
        fn = fn.fn
    return sum(len(entry[0]) for entry in fn.device_caches.values())
