"""benchmarks/fa4_contact.py's float64 reference (what FA4 is measured against on the GPU), checked on the CPU
against SDPA in float64 with the equivalent boolean mask; and the script refusing a machine without a GPU."""
import importlib
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, child_env, run_process


@pytest.fixture(scope="module")
def contact():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "benchmarks"))
        return importlib.import_module("fa4_contact")


@pytest.mark.parametrize("causal,window,docs,gqa", [
    (False, None, None, 1), (True, None, None, 4), (True, (5, 0), None, 1), (True, None, [0, 7, 12, 20], 2)])
def test_the_reference_is_sdpa_in_float64_with_the_same_mask(contact, causal, window, docs, gqa):
    torch.manual_seed(0)
    b, n, h, d = (1 if docs else 2), 20, 4, 8
    q = torch.randn(b, n, h, d)
    k, v = torch.randn(b, n, h // gqa, d), torch.randn(b, n, h // gqa, d)
    do = torch.randn(b, n, h, d)
    got = contact.reference(q, k, v, do, causal, window, 0.0, docs)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = torch.ones(n, n, dtype=torch.bool)
    if causal:
        mask &= j <= i
    if window:
        mask &= j >= i - window[0]
    if docs:
        doc = torch.bucketize(torch.arange(n), torch.tensor(docs[1:-1]), right=True)
        mask &= doc[:, None] == doc[None, :]
    qs, ks, vs = (t.double().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa > 1)
    o.backward(do.double().transpose(1, 2))
    want = [o.detach().transpose(1, 2), qs.grad.transpose(1, 2), ks.grad.transpose(1, 2), vs.grad.transpose(1, 2)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_the_script_says_it_needs_a_gpu(tmp_path):
    proc = run_process([sys.executable, str(REPO / "benchmarks" / "fa4_contact.py")], env=child_env(tmp_path),
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
