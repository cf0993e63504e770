"""torch.compile sees flash_attention as one op: fullgraph=True, probes and shadow steps included."""
import pytest
import torch
import torch.nn as nn

from helpers import seeded
from instability_watch import Probe, flash_attention


class TinyAttention(nn.Module):
    """A causal self-attention block that calls flash_attention directly."""

    def __init__(self, dim=64, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.probe = Probe(heads)
        self.stabilize = torch.tensor([False, True])

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).to(torch.bfloat16).split(C, dim=2)
        q, k, v = (t.view(B, N, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)
        o = flash_attention(q, k, v, causal=True, stabilize=self.stabilize, probe=self.probe)
        return self.proj(o.transpose(1, 2).reshape(B, N, C).float())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_matches_eager(backend):
    torch._dynamo.reset()
    eager = TinyAttention()
    compiled_model = TinyAttention()
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    x = torch.randn(2, 33, 64, generator=seeded("compile", backend))
    for shadow in (False, True):
        eager.probe.shadow = compiled_model.probe.shadow = shadow
        ye, yc = eager(x), compiled(x)
        ye.square().sum().backward()
        yc.square().sum().backward()
        torch.testing.assert_close(yc, ye, atol=2e-2, rtol=2e-2)
    for (name, pe), pc in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, atol=5e-2, rtol=5e-2, msg=name)
    # The op's writes into the probe happen under compile too, the shadow backward's included.
    assert compiled_model.probe.rows.tolist() == eager.probe.rows.tolist() == [132, 132]
    assert compiled_model.probe.shadow_rows.tolist() == eager.probe.shadow_rows.tolist() == [66, 66]
    assert torch.equal(compiled_model.probe.multi_max_rows, eager.probe.multi_max_rows)
    assert (compiled_model.probe.delta_err_abs > 0).all()


def test_no_graph_break_at_attention():
    torch._dynamo.reset()
    model = TinyAttention()
    x = torch.randn(1, 16, 64)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1
