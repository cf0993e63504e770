"""Our kernels over packed documents (flash_attention_varlen): the Triton kernels with their document mask (CPU:
Triton's interpreter) against the same kernels with the documents as a dense boolean mask, and against the
documents run one by one."""
import pytest
import torch

from instability_watch import flash_attention, flash_attention_varlen

from helpers import count_document_searches, max_err, seeded

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("the interpreter tests are for CPU-only machines", allow_module_level=True)

H, H_KV, D = 4, 2, 32
CU = [0, 37, 50, 97]


def _inputs(key, tail=0, dtype=torch.bfloat16):
    g = seeded("varlen_kernels", *key)
    t = CU[-1] + tail
    q = torch.randn(t, H, D, generator=g).to(dtype)
    k, v = (torch.randn(CU[-1], H_KV, D, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(t, H, D, generator=g).to(dtype)
    return q, k, v, do


def _fwd_bwd(fn, q, k, v, do):
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = fn(qq, kk, vv)
    o.backward(do)
    return o.detach(), qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("window, stab", [((-1, 0), None), ((9, 0), None), ((5, 3), None), ((-1, 0), "half")])
def test_documents_equal_the_documents_run_one_by_one(window, stab):
    """Each document's output and gradients, from one packed call, are those of the document alone (its own
    causal/window mask as a boolean mask), up to the order of float32 sums (tiles fall elsewhere)."""
    q, k, v, do = _inputs(("one_by_one", window, stab))
    cu = torch.tensor(CU, dtype=torch.int32)
    stabilize = torch.tensor([False, True, False, True]) if stab else None
    packed = _fwd_bwd(lambda a, b, c: flash_attention_varlen(a, b, c, cu, window=window, stabilize=stabilize,
                                                             backend="triton"), q, k, v, do)
    for d in range(len(CU) - 1):
        sl = slice(CU[d], CU[d + 1])
        n = CU[d + 1] - CU[d]
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        keep = (j >= i - window[0] if window[0] >= 0 else torch.ones(n, n, dtype=torch.bool)) & (j <= i + window[1])
        as4 = (lambda t: t.permute(1, 0, 2).unsqueeze(0))
        alone = _fwd_bwd(lambda a, b, c: flash_attention(as4(a), as4(b), as4(c), attn_mask=keep, stabilize=stabilize,
                                                         backend="triton")[0].permute(1, 0, 2),
                         q[sl], k[sl], v[sl], do[sl])
        for got, want in zip(packed, alone):
            assert max_err(got[sl], want) <= 2 ** -6 * want.abs().max()


@pytest.mark.parametrize("edge_loop", [False, True])
def test_the_document_mask_equals_the_dense_mask_bitwise_and_rows_past_the_end_are_zero(edge_loop, monkeypatch):
    """A packed call's output equals the same call with its documents as a dense boolean mask: bit for bit where
    both walk a query tile's key tiles in the same order (the dense mask's forward in four loops, as the documents'
    three); with the edge loop (the whole run first) up to the order of float32 sums (O's BF16 rounding may differ
    by a unit)."""
    from instability_watch.kernels.attention import triton as ta

    monkeypatch.setattr(ta, "EDGE_LOOP", ("fwd", "dkdv") if edge_loop else ())
    q, k, v, do = _inputs(("dense",), tail=5)
    cu = torch.tensor(CU, dtype=torch.int32)
    o, lse = flash_attention_varlen(q, k, v, cu, causal=True, backend="triton", return_lse=True)
    from instability_watch.kernels.common import documents

    doc_q, pos_q, doc_k, pos_k = documents(cu, cu, q.shape[0], k.shape[0])
    mask = ((doc_q[:, None] == doc_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])).view(1, 1, q.shape[0], -1)
    as4 = (lambda t: t.permute(1, 0, 2).unsqueeze(0))
    dense = flash_attention(as4(q), as4(k), as4(v), attn_mask=mask, backend="triton")[0].permute(1, 0, 2)
    if edge_loop:
        torch.testing.assert_close(o.float(), dense.float(), rtol=2 ** -7, atol=2 ** -8)  # one BF16 rounding
    else:
        assert torch.equal(o, dense)
    assert (o[CU[-1]:] == 0).all() and torch.isinf(lse[:, CU[-1]:]).all()
    # the log-sum-exp of each row's scores, natural log
    s = torch.einsum("nhd,mhd->hnm", q.double(), k.double().repeat_interleave(2, 1)) * D ** -0.5
    s = s.masked_fill(~mask[0], float("-inf"))[:, :CU[-1]]
    torch.testing.assert_close(lse[:, :CU[-1]].double(), s.logsumexp(-1), rtol=1e-5, atol=1e-4)
    # the reference backend (a dense mask: it is the oracle) agrees
    ref = flash_attention_varlen(q, k, v, cu, causal=True, backend="reference")
    assert max_err(ref[:CU[-1]], o[:CU[-1]]) <= 2 ** -7 * o.abs().max()


def test_bad_arguments_are_named():
    q = torch.zeros(10, 2, 8)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be a 3-D tensor"):
        flash_attention_varlen(q[None], q, q, cu)
    with pytest.raises(ValueError, match="cu_seq_q must be an int32/int64 vector"):
        flash_attention_varlen(q, q, q, cu.float())
    with pytest.raises(ValueError, match="same number of documents"):
        flash_attention_varlen(q, q, q, cu, torch.tensor([0, 5, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="window must be"):
        flash_attention_varlen(q, q, q, cu, window=(1,))


@pytest.mark.parametrize("packed", [False, True])
def test_the_log_sum_exp_gradient_enters_the_backward(packed):
    """A loss of the output and of the returned log-sum-exp (as attention sinks use it): the Triton kernels'
    gradients equal autograd through float32 PyTorch attention within BF16 rounding, the lse's share
    included (without it they would differ by far more); dense causal calls and packed documents."""
    q, k, v, do = _inputs(("lse_grad", packed))
    cu = torch.tensor(CU, dtype=torch.int32)
    w = torch.randn(H, CU[-1], generator=seeded("lse_grad_w", packed)) * 4
    as4 = (lambda t: t.permute(1, 0, 2).unsqueeze(0))
    t = CU[-1]
    if packed:
        doc = torch.repeat_interleave(torch.arange(len(CU) - 1), torch.tensor(CU).diff())
        keep = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    else:
        keep = torch.ones(t, t, dtype=torch.bool).tril()

    def ours(a, b, c):
        if packed:
            return flash_attention_varlen(a, b, c, cu, causal=True, backend="triton", return_lse=True)
        o, lse = flash_attention(as4(a), as4(b), as4(c), causal=True, backend="triton", return_lse=True)
        return o[0].permute(1, 0, 2), lse[0]

    def exact(a, b, c):
        s = (as4(a).float() @ as4(b).float().repeat_interleave(H // H_KV, 1).transpose(-1, -2)) / D ** 0.5
        s = s.masked_fill(~keep, float("-inf"))
        o = torch.softmax(s, dim=-1) @ as4(c).float().repeat_interleave(H // H_KV, 1)
        return o[0].permute(1, 0, 2), torch.logsumexp(s, dim=-1)[0]

    grads = {}
    for name, fn in (("ours", ours), ("exact", exact)):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        o, lse = fn(*leaves)
        ((o.float() * do.float()).sum() + (lse * w).sum()).backward()
        grads[name] = [x.grad.float() for x in leaves]
        if name == "ours":
            torch.testing.assert_close(lse, exact(q, k, v)[1], rtol=0, atol=1e-2)
    for got, want in zip(grads["ours"], grads["exact"]):
        assert max_err(got, want) <= 2 ** -6 * want.abs().max()
    # the lse's share is large: leaving it out would fail the same bound
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    o, _ = exact(*leaves)
    (o * do.float()).sum().backward()
    assert max_err(leaves[0].grad, grads["exact"][0]) > 2 ** -4 * grads["exact"][0].abs().max()


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (9, 0), (5, 3), (0, 7)])
@pytest.mark.parametrize("same_lengths", [True, False])
def test_each_tile_visits_exactly_the_keys_its_rows_may_see(window, same_lengths):
    """The per-tile ranges the kernels loop over (query tiles: keys; key tiles: rows) are exactly the span of
    what the document mask keeps for the tile's rows (keys): nothing kept is outside (the kernels would miss it),
    and nothing before the first or after the last kept key is visited (a causal tile stops at its own rows).
    Within it, the tiles the kernels read without the mask are exactly those every row of the tile sees whole."""
    from instability_watch.kernels.attention.ops import _documents
    from instability_watch.kernels.attention.triton import Documents

    cu_q = torch.tensor([0, 37, 50, 97, 160])
    cu_k = cu_q if same_lengths else torch.tensor([0, 30, 52, 110, 171])
    t_q, t_k = int(cu_q[-1]) + 6, int(cu_k[-1]) + 3  # rows and keys past the documents
    docs = Documents(cu_q, cu_k, t_q, t_k, window)
    keep = _documents(torch.empty(1, 1, t_q, 1), torch.empty(1, 1, t_k, 1), cu_q, cu_k, *window, "reference")[1][0, 0]
    n_whole = 0
    for block, other in ((16, 16), (32, 16), (64, 32), (16, 64)):
        for (ranges, _), mask in ((docs.rows(block, other), keep), (docs.cols(block, other), keep.T)):
            for i, start in enumerate(range(0, mask.shape[0], block)):
                tile = mask[start:start + block]
                seen = tile.any(dim=0).nonzero().flatten()
                want = (int(seen.min()), int(seen.max()) + 1) if seen.numel() else (0, 0)
                lo, hi, w0, w1 = (int(x) for x in ranges[i])
                assert (lo, hi) == want, (block, i, window)
                whole = [j for j in range(0, mask.shape[1] - other + 1, other) if tile[:, j:j + other].all()]
                assert list(range(w0, w1, other)) == whole, (block, other, i, window)
                n_whole += len(whole)
    if window[0] < 0:  # (a window under 16 keys leaves no tile whole)
        assert n_whole > 0


def test_the_exact_delta_over_documents_and_with_the_log_sum_exp():
    """``high_precision_delta`` on packed calls (the exact-delta switch serves varlen calls): the packed call's
    gradients are each document's alone with the exact delta; with the log-sum-exp in the loss, the kernels'
    own pre-pass gives what PyTorch's float32 O gives (``INSTABILITY_WATCH_HP_DELTA=pytorch``); and the shadow
    statistics of a call whose loss reads its log-sum-exp are those of the same call without it (they compare
    ``rowsum(dO * O)``, not delta with the lse's share)."""
    import os
    from unittest import mock

    from instability_watch import Probe

    q, k, v, do = _inputs(("exact_delta",))
    cu = torch.tensor(CU, dtype=torch.int32)
    packed = _fwd_bwd(lambda a, b, c: flash_attention_varlen(a, b, c, cu, causal=True, high_precision_delta=True,
                                                             backend="triton"), q, k, v, do)
    plain = _fwd_bwd(lambda a, b, c: flash_attention_varlen(a, b, c, cu, causal=True, backend="triton"), q, k, v, do)
    as4 = (lambda t: t.permute(1, 0, 2).unsqueeze(0))
    for d in range(len(CU) - 1):
        sl = slice(CU[d], CU[d + 1])
        alone = _fwd_bwd(lambda a, b, c: flash_attention(as4(a), as4(b), as4(c), causal=True, high_precision_delta=True,
                                                         backend="triton")[0].permute(1, 0, 2),
                         q[sl], k[sl], v[sl], do[sl])
        for got, want in zip(packed[1:3], alone[1:3]):  # dQ, dK (dV takes no delta)
            assert max_err(got[sl], want) <= 2 ** -6 * want.abs().max()
    assert max_err(packed[1], plain[1]) > 0  # the exact delta changed dQ

    w = torch.randn(H, CU[-1], generator=seeded("exact_delta_w")) * 4

    def with_lse(a, b, c, probe=None, use_lse=True):
        o, lse = flash_attention_varlen(a, b, c, cu, causal=True, high_precision_delta=probe is None,
                                        probe=probe, backend="triton", return_lse=True)
        return (o.float() * do.float()).sum() + ((lse * w).sum() if use_lse else 0)

    grads = {}
    for how in ("kernel", "pytorch"):
        with mock.patch.dict(os.environ, {"INSTABILITY_WATCH_HP_DELTA": how}):
            leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
            with_lse(*leaves).backward()
            grads[how] = [x.grad.float() for x in leaves]
    for got, want in zip(grads["kernel"], grads["pytorch"]):
        assert max_err(got, want) <= 2 ** -7 * want.abs().max()

    sums = []
    for use_lse in (False, True):
        probe = Probe(H)
        probe.shadow = True
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        with_lse(*leaves, probe=probe, use_lse=use_lse).backward()
        sums.append(probe.delta_err_sum.clone())
    assert sums[0].abs().max() > 0
    torch.testing.assert_close(sums[1], sums[0], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("window", [(-1, 0), (9, 0), (-1, -1)])
def test_the_fused_backward_over_documents_equals_the_two_kernels(window, monkeypatch):
    """``FUSED_BACKWARD`` (the benchmarks' variant: one dK/dV kernel adding dQ by atomics) on packed calls: the
    gradients of the two-kernel backward up to the order of float32 sums, the output bit for bit; the fused
    kernel is what ran."""
    import instability_watch.kernels.attention.triton as ta

    q, k, v, do = _inputs(("fused", window), dtype=torch.float32)
    cu = torch.tensor(CU, dtype=torch.int32)
    fused_launches = []
    launch = ta.launch_dkdv
    monkeypatch.setattr(ta, "launch_dkdv", lambda grid, t, s, meta: fused_launches.append(meta["FUSED_DQ"])
                        or launch(grid, t, s, meta))
    outs = {}
    for fused in (False, True):
        monkeypatch.setattr(ta, "FUSED_BACKWARD", fused)
        outs[fused] = _fwd_bwd(lambda a, b, c: flash_attention_varlen(a, b, c, cu, window=window, backend="triton"),
                               q, k, v, do)
    assert fused_launches == [False, True]
    assert torch.equal(outs[False][0], outs[True][0])
    for two, one in zip(outs[False][1:], outs[True][1:]):
        assert one.abs().max() > 0 and max_err(one, two) <= 1e-5 * two.abs().max()


@pytest.mark.parametrize("case", ["documents", "window", "bool mask", "probe"])
def test_tiles_launched_in_the_order_of_their_work_give_the_same_results(case, monkeypatch):
    """``TILE_ORDER`` (the benchmarks' variant: a call's tiles launched widest range first, grid (heads, tiles)):
    forward and both backward kernels read their tile from the order and give the very same output and gradients,
    and with a probe the same counts; each launch took the order, a permutation that starts with the widest
    tile."""
    import instability_watch.kernels.attention.triton as ta
    from instability_watch import Probe

    q, k, v, do = _inputs(("order", case))
    cu = torch.tensor(CU, dtype=torch.int32)
    window = (9, 0) if case == "window" else (-1, 0)
    seen = []
    for name in ("launch_fwd", "launch_dq", "launch_dkdv"):
        launch = getattr(ta, name)
        monkeypatch.setattr(ta, name, lambda grid, t, s, meta, _l=launch, _n=name: seen.append(
            (_n, grid, meta["ORDERED"], *((t[-3], t[-2]) if _n == "launch_dkdv" else t[11:13] if _n == "launch_dq"
                                          else t[9:11])))
            or _l(grid, t, s, meta))
    outs, probes = {}, {}
    for ordered in (False, True):
        monkeypatch.setattr(ta, "TILE_ORDER", ordered)
        probes[ordered] = probe = Probe(H) if case == "probe" else None
        if case == "bool mask":
            n = CU[-1]
            keep = (torch.rand(1, 1, n, n, generator=seeded("order_mask")) < 0.7) & torch.ones(n, n).tril().bool()
            keep |= torch.eye(n, dtype=torch.bool)  # causal, with holes: tiles of different widths

            def fn(a, b, c):
                as4 = (lambda t: t.permute(1, 0, 2).unsqueeze(0))
                return flash_attention(as4(a), as4(b), as4(c), attn_mask=keep, backend="triton")[0].permute(1, 0, 2)
        else:
            def fn(a, b, c):
                return flash_attention_varlen(a, b, c, cu, window=window, probe=probe, backend="triton")
        outs[ordered] = _fwd_bwd(fn, q, k, v, do)
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)
    if case == "probe":
        assert torch.equal(probes[False].counts, probes[True].counts)
        assert probes[True].counts.sum() > 0
    plain = [s for s in seen if not s[2]]
    ordered = [s for s in seen if s[2]]
    assert {s[0] for s in ordered} == {"launch_fwd", "launch_dq", "launch_dkdv"} and len(plain) == len(ordered)
    for (name, grid, _, ranges, order), (_, grid0, _, _, none) in zip(ordered, plain):
        assert none is None and grid == grid0[::-1]  # (heads, tiles) where it was (tiles, heads)
        assert sorted(order.tolist()) == list(range(grid[1])) and order.dtype == torch.int32
        span = ranges[..., 1] - ranges[..., 0]
        while span.dim() > 1:
            span = span.amax(dim=0)
        assert (span[order.long()].diff() <= 0).all() and span.unique().numel() > 1, name  # the widest first


def test_a_kept_call_s_backward_reuses_its_documents_outside_the_forward_s_context(monkeypatch):
    """A watch keeps a routed call's documents around its forward only; the backward runs later (on a GPU in
    autograd's own thread) and must use them too, not find them afresh: one search for forward and backward."""
    from instability_watch.kernels.attention import ops

    made = count_document_searches(monkeypatch)
    ops.forget_documents()
    cu = torch.tensor(CU, dtype=torch.int32)
    q, k, v, do = _inputs(("kept_backward",))
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    token = ops.KEEP_DOCUMENTS.set(True)
    try:
        o = flash_attention_varlen(qq, kk, vv, cu, causal=True, backend="triton")
    finally:
        ops.KEEP_DOCUMENTS.reset(token)
    assert len(made) == 1
    o.backward(do)
    assert len(made) == 1  # the backward took the forward's documents
    o2 = flash_attention_varlen(qq, kk, vv, cu.clone(), causal=True, backend="triton")  # a direct call: its own
    o2.backward(do)
    assert len(made) == 3
    ops.forget_documents()


def test_the_documents_of_a_batch_are_found_once_for_every_layer_and_again_when_they_change():
    """The layers of a step pass the same boundary tensors: their documents (and the tiles' ranges) are kept and
    reused, forward and backward. A boundary tensor refilled in place, or another tensor, is new documents; and
    the outputs stay those of a call that finds them afresh."""
    from instability_watch.kernels.attention import ops

    ops.forget_documents()
    cu = torch.tensor(CU, dtype=torch.int32)
    q, k, v, do = _inputs(("kept",))
    first = ops.kept_documents(cu, cu, CU[-1], CU[-1], (-1, 0))
    assert ops.kept_documents(cu, cu, CU[-1], CU[-1], (-1, 0)) is first
    assert ops.kept_documents(cu, cu, CU[-1], CU[-1], (9, 0)) is not first  # another window: other ranges
    assert ops.kept_documents(cu.clone(), cu, CU[-1], CU[-1], (-1, 0)) is not first  # another tensor
    # a direct call keeps nothing (a buffer refilled behind PyTorch's back would be read stale); a watch's call does
    _fwd_bwd(lambda a, b, c: flash_attention_varlen(a, b, c, cu.clone(), causal=True, backend="triton"), q, k, v, do)
    assert len(ops._DOCUMENTS) == 3
    token = ops.KEEP_DOCUMENTS.set(True)
    outs = [_fwd_bwd(lambda a, b, c: flash_attention_varlen(a, b, c, cu, causal=True, backend="triton"), q, k, v,
                     do)]
    assert len(ops._DOCUMENTS) == 3  # the call's documents were the ones kept
    cu[1] = 20  # refilled in place: new documents
    moved = ops.kept_documents(cu, cu, CU[-1], CU[-1], (-1, 0))
    assert moved is not first and int(moved.doc_q[25]) == 1 and int(first.doc_q[25]) == 0
    outs.append(_fwd_bwd(lambda a, b, c: flash_attention_varlen(a, b, c, cu, causal=True, backend="triton"), q, k,
                         v, do))
    ops.KEEP_DOCUMENTS.reset(token)
    ops.forget_documents()
    fresh = _fwd_bwd(lambda a, b, c: flash_attention_varlen(a, b, c, cu.clone(), causal=True, backend="triton"),
                     q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(outs[1], fresh))
    assert not torch.equal(outs[0][0], outs[1][0])
    with torch.inference_mode():  # no version counter: found afresh each time, not kept
        cu_inf = torch.tensor(CU, dtype=torch.int32)
    assert ops.kept_documents(cu_inf, cu_inf, CU[-1], CU[-1], (-1, 0)) is not ops.kept_documents(
        cu_inf, cu_inf, CU[-1], CU[-1], (-1, 0))
    for i in range(ops.DOCUMENTS_KEPT + 3):
        ops.kept_documents(torch.tensor(CU), torch.tensor(CU), CU[-1], CU[-1], (i, 0))
    assert len(ops._DOCUMENTS) == ops.DOCUMENTS_KEPT
    # a write PyTorch does not count (through .data) is seen once the watch's step forgets what was kept
    from instability_watch import InstabilityWatch

    watch = InstabilityWatch(torch.nn.MultiheadAttention(8, 2))
    kept = ops.kept_documents(cu, cu, CU[-1], CU[-1], (-1, 0))
    cu.data[1] = 30
    assert ops.kept_documents(cu, cu, CU[-1], CU[-1], (-1, 0)) is kept  # within the step: as documented
    watch.step()
    assert not ops._DOCUMENTS
    assert int(ops.kept_documents(cu, cu, CU[-1], CU[-1], (-1, 0)).doc_q[25]) == 0
    watch.detach()
    ops.forget_documents()


def test_packed_calls_take_their_own_dkdv_tiles(monkeypatch):
    """The launch table's "dkdv_docs" entry (measured on packed calls, D = 128) serves packed calls' dK/dV; a dense
    call keeps "dkdv"'s. The gradients are those of the interpreter's tiles up to float32 sums in another order."""
    from instability_watch.kernels import configs
    from instability_watch.kernels.attention import triton as ta

    d = 128
    g = seeded("varlen_kernels", "docs tiles")
    q = torch.randn(CU[-1], H, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(CU[-1], H_KV, d, generator=g).to(torch.bfloat16) for _ in range(2))
    do = torch.randn(CU[-1], H, d, generator=g).to(torch.bfloat16)
    cu = torch.tensor(CU, dtype=torch.int32)
    packed = (lambda a, b, c: flash_attention_varlen(a, b, c, cu, causal=True, backend="triton"))
    as4 = (lambda t: t.permute(1, 0, 2).unsqueeze(0))
    dense = (lambda a, b, c: flash_attention(as4(a), as4(b), as4(c), causal=True, backend="triton")[0])
    small = _fwd_bwd(packed, q, k, v, do)  # the interpreter's 16 x 16 tiles
    tiles = []
    launch = ta.launch_dkdv
    monkeypatch.setattr(ta, "launch_dkdv", lambda grid, t, s, meta: launch(grid, t, s, meta) or tiles.append(
        (meta["BLOCK_M"], meta["BLOCK_N"])))
    monkeypatch.setattr(configs, "INTERPRET", False)  # launch_config reads the table, as on the GPU
    table = _fwd_bwd(packed, q, k, v, do)
    _fwd_bwd(dense, q, k, v, do.permute(1, 0, 2))
    docs, plain = (configs.launch_config(kind, d, torch.bfloat16) for kind in ("dkdv_docs", "dkdv"))
    assert (docs.block_m, docs.block_n) != (plain.block_m, plain.block_n)
    assert tiles == [(docs.block_m, docs.block_n), (plain.block_m, plain.block_n)]
    for a, b in zip(small, table):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape, expand", [((2, 3, 37), None), ((1, 1, 5), (4, 8)), ((70,), None), ((1, 2, 300), None)])
def test_tiles_by_work_is_argsort_of_the_widest_span_on_the_device(shape, expand):
    """The launch order of ``TILE_ORDER`` found in one launch (``masks.tiles_by_work``): exactly
    ``torch.argsort(span.amax over batch and heads, descending=True, stable=True)`` (ties in tile order), for
    ranges per batch entry and head, broadcast over them (stride 0), of one plane (a packed call's), and more
    tiles than one block of the program."""
    from instability_watch.kernels.attention.masks import tiles_by_work

    g = seeded("tiles by work", shape)
    lo = torch.randint(0, 4, shape, generator=g) * 16
    hi = lo + torch.randint(0, 4, shape, generator=g) * 16  # few distinct spans: many ties
    ranges = torch.stack([lo, hi, lo, lo, hi], dim=-1).to(torch.int32)
    if expand is not None:
        ranges = ranges.expand(*expand, *ranges.shape[2:])
    span = ranges[..., 1] - ranges[..., 0]
    while span.dim() > 1:
        span = span.amax(dim=0)
    want = torch.argsort(span, descending=True, stable=True).to(torch.int32)
    got = tiles_by_work(ranges)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_calls_with_a_boolean_mask_take_their_own_backward_entries(monkeypatch):
    """The launch table's "dkdv_mask" and "dq_mask" entries (measured on switched flex calls, D = 128) serve the
    backward of calls with a boolean mask; an additive mask and a plain causal call keep "dkdv"'s and "dq"'s. The
    gradients are the interpreter's small tiles' up to float32 sums in another order."""
    from instability_watch.kernels import configs
    from instability_watch.kernels.attention import triton as ta

    d, n = 128, CU[-1]
    g = seeded("varlen_kernels", "mask stages")
    q = torch.randn(1, H, n, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, H_KV, n, d, generator=g).to(torch.bfloat16) for _ in range(2))
    do = torch.randn(1, H, n, d, generator=g).to(torch.bfloat16)
    keep = (torch.rand(n, n, generator=g) < 0.8) & torch.ones(n, n).tril().bool()
    keep |= torch.eye(n, dtype=torch.bool)
    calls = {"bool": dict(attn_mask=keep), "additive": dict(attn_mask=torch.zeros(n, n).masked_fill(~keep, -1e9)),
             "causal": dict(causal=True)}

    def run(how):
        return _fwd_bwd(lambda a, b, c: flash_attention(a, b, c, backend="triton", **calls[how]), q, k, v, do)

    small = {how: run(how) for how in calls}  # the interpreter's 16 x 16 tiles
    seen = {"dkdv": [], "dq": []}
    for kernel in seen:
        launch = getattr(ta, f"launch_{kernel}")
        monkeypatch.setattr(ta, f"launch_{kernel}", lambda grid, t, s, meta, launch=launch, kernel=kernel: launch(
            grid, t, s, meta) or seen[kernel].append(
            (meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"], meta["num_stages"])))
    monkeypatch.setattr(configs, "INTERPRET", False)  # launch_config reads the table, as on the GPU
    table = {how: run(how) for how in calls}
    as_meta = (lambda c: (c.block_m, c.block_n, c.num_warps, c.num_stages))
    for kernel in seen:
        own, plain = (as_meta(configs.launch_config(kind, d, torch.bfloat16)) for kind in (f"{kernel}_mask", kernel))
        assert own != plain
        assert seen[kernel] == [own, plain, plain], kernel
    for how in calls:
        for a, b in zip(small[how], table[how]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_watched_calls_with_a_boolean_mask_take_the_forward_entry_of_their_own(monkeypatch):
    """The launch table's "fwd_mask" entry (measured on switched flex calls, D = 128) serves the forward of calls
    with a boolean mask, watched (a stabilized head) or not; a watched call with an additive mask or the causal flag
    keeps "fwd_watched"'s. The outputs are the interpreter's small tiles' up to float32 sums in another order."""
    from instability_watch.kernels import configs
    from instability_watch.kernels.attention import triton as ta

    d, n = 128, CU[-1]
    g = seeded("varlen_kernels", "forward entry")
    q = torch.randn(1, H, n, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, H_KV, n, d, generator=g).to(torch.bfloat16) for _ in range(2))
    keep = torch.ones(n, n).tril().bool() & (torch.rand(n, n, generator=g) < 0.9)
    keep |= torch.eye(n, dtype=torch.bool)
    stab = torch.zeros(H, dtype=torch.bool)
    stab[1] = True
    calls = {"bool": dict(attn_mask=keep, stabilize=stab), "bool, plain": dict(attn_mask=keep),
             "additive": dict(attn_mask=torch.zeros(n, n).masked_fill(~keep, -1e9), stabilize=stab),
             "causal": dict(causal=True, stabilize=stab)}

    def run(how):
        with torch.no_grad():
            return flash_attention(q, k, v, backend="triton", **calls[how])

    small = {how: run(how) for how in calls}  # the interpreter's 16 x 16 tiles
    seen = []
    launch = ta.launch_fwd
    monkeypatch.setattr(ta, "launch_fwd", lambda grid, t, s, meta: launch(grid, t, s, meta) or seen.append(
        (meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"], meta["num_stages"])))
    monkeypatch.setattr(configs, "INTERPRET", False)  # launch_config reads the table, as on the GPU
    # the entry made unlike both dense forwards' (the table's equals the plain forward's): which one a call took shows
    monkeypatch.setitem(configs.LAUNCH_TABLE[("fwd_mask", configs.TENSOR_CORES)], d, configs.LaunchConfig.of(
        (64, 32, 4, 2)))
    table = {how: run(how) for how in calls}
    as_meta = (lambda c: (c.block_m, c.block_n, c.num_warps, c.num_stages))
    own = as_meta(configs.launch_config("fwd_mask", d, torch.bfloat16))
    plain, watched = (as_meta(configs.launch_config("fwd", d, torch.bfloat16, watched=w)) for w in (False, True))
    assert own not in (plain, watched)
    assert seen == [own, own, watched, watched]
    for how in calls:
        torch.testing.assert_close(small[how].float(), table[how].float(), rtol=2e-2, atol=2e-2)
