"""sigma_max(W_Q[h]) for every layer and head in one batched computation."""
import pytest
import torch

from instability_watch.probe.spectral import SpectralNorms, top_singular_values


def _rel_err(sigmas, weights):
    ref = torch.linalg.matrix_norm(weights.double(), ord=2)
    return ((sigmas.double() - ref).abs() / ref).max().item()


@pytest.mark.parametrize("shape", [(144, 64, 768), (8, 128, 512), (4, 32, 32), (3, 16, 64)])
def test_cold_start_within_1e_3_of_matrix_norm(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    sigma, _ = top_singular_values(w)
    assert _rel_err(sigma, w) < 1e-3


def test_near_degenerate_top_singular_values():
    g = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(6, 64, 64, generator=g))
    v, _ = torch.linalg.qr(torch.randn(6, 256, 64, generator=g))
    s = torch.linspace(1.0, 0.1, 64).repeat(6, 1)
    s[:, 1] = 0.99999  # top two almost equal: plain power iteration crawls here
    w = u @ torch.diag_embed(s) @ v.transpose(1, 2)
    sigma, _ = top_singular_values(w)
    assert _rel_err(sigma, w) < 1e-3


def test_groups_of_different_shapes_and_warm_start_over_training_drift():
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(4, 32, 128, generator=g), torch.randn(8, 16, 128, generator=g), torch.randn(4, 32, 128, generator=g)]
    norms = SpectralNorms()
    for _ in range(4):
        out = norms(weights)
        assert [tuple(o.shape) for o in out] == [(4,), (8,), (4,)]
        for o, w in zip(out, weights):
            assert _rel_err(o, w) < 1e-3
        weights = [w + 0.05 * torch.randn(w.shape, generator=g) for w in weights]
    # rank-one growth along one direction (the paper's W_Q picture)
    w = weights[0].clone()
    w[1] += 3.0 * torch.outer(torch.randn(32, generator=g), torch.randn(128, generator=g)) / 32
    out = norms([w, weights[1], weights[2]])
    assert _rel_err(out[0], w) < 1e-3


def test_zero_and_nan_weights():
    w = torch.zeros(2, 16, 16)
    w[1] = float("nan")
    sigma, _ = top_singular_values(w)
    assert sigma[0].item() == 0.0 and sigma[1].item() == float("inf")  # an alert, not "not measured"


def test_state_dict_round_trip_gives_identical_results():
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(4, 16, 64, generator=g)]
    a = SpectralNorms()
    a(w)
    b = SpectralNorms()
    b.load_state_dict(a.state_dict())
    w2 = [w[0] + 0.1]
    assert torch.equal(a(w2)[0], b(w2)[0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="squarings must be an int >= 0"):
        SpectralNorms(squarings=-1)
    with pytest.raises(ValueError, match="power_steps must be an int >= 0"):
        SpectralNorms(power_steps=1.5)
