"""`instability-watch demo`: the paper's rounding bias, and the fix, on one screen.

Builds attention inputs whose score rows hold several maxima within 1e-3 of
each other (``mechanism.near_tie_inputs``), runs them through the standard and
the stabilized kernels, and shows their signed error against float64 next to
a control with a single maximum per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from .mechanism import measure_bias, near_tie_inputs


@dataclass(frozen=True)
class DemoRow:
    """Aggregated measurements of one (input case, kernel) pair over several random draws."""

    case: str
    kernel: str
    multi_max_frac: float
    o_bias: float  # mean signed error of O in the negative-V dims
    delta_err_mean: float  # mean over draws of sum_rows(delta_lp - delta_hp)
    delta_positive_draws: int
    draws: int


def run(
    *, draws: int = 8, seq: int = 256, heads: int = 4, n_ties: int = 4, device: str = "cpu", seed: int = 0
) -> List[DemoRow]:
    """Measure the three cases of the demo. Deterministic for a given ``seed``."""
    cases = [
        ("1 maximum", 1, "standard", False),
        (f"{n_ties} near-tied", n_ties, "standard", False),
        (f"{n_ties} near-tied", n_ties, "stabilized", True),
    ]
    rows = []
    for case, ties, kernel, stabilize in cases:
        results = []
        for d in range(draws):
            g = torch.Generator().manual_seed(seed * 1000 + d)
            inp = near_tie_inputs(batch=2, heads=heads, seq=seq, n_ties=ties, device=device, generator=g)
            results.append(measure_bias(inp, stabilize=stabilize))
        mean = lambda key: sum(r[key] for r in results) / draws  # noqa: E731
        rows.append(
            DemoRow(
                case=case,
                kernel=kernel,
                multi_max_frac=mean("multi_max_frac"),
                o_bias=mean("o_bias"),
                delta_err_mean=mean("delta_err_sum"),
                delta_positive_draws=sum(r["delta_err_sum"] > 0 for r in results),
                draws=draws,
            )
        )
    return rows


class DemoTable:
    """Rich renderable of the demo's measurements."""

    def __init__(self, rows: List[DemoRow], *, backend: str) -> None:
        self.rows = rows
        self.backend = backend

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        control = abs(self.rows[0].o_bias) or 1e-12
        table = Table(
            title="BF16 flash attention (FA2 precision) against float64\n"
            f"{self.rows[0].draws} random draws per row, {self.backend}",
            title_justify="left",
            box=box.SIMPLE_HEAD,
        )
        table.add_column("row maxima", no_wrap=True)
        table.add_column("kernel", no_wrap=True)
        table.add_column("rows\ntied", justify="right", no_wrap=True)
        table.add_column("O bias\n(1e-5)", justify="right", no_wrap=True)
        table.add_column("× 1\nmax", justify="right", no_wrap=True)
        table.add_column("Σ δlp−δhp\nper draw", justify="right", no_wrap=True)
        table.add_column("Σ > 0", justify="right", no_wrap=True)
        for r in self.rows:
            style = "bold red" if r.kernel == "standard" and r.multi_max_frac > 0 else ""
            table.add_row(
                r.case,
                r.kernel,
                f"{100 * r.multi_max_frac:.0f}%",
                Text(f"{r.o_bias * 1e5:+.2f}", style=style),
                f"{abs(r.o_bias) / control:.1f}",
                Text(f"{r.delta_err_mean:+.3f}", style=style),
                f"{r.delta_positive_draws}/{r.draws}",
            )
        yield table
        yield Text.from_markup(
            "[bold]O bias[/]: mean signed error of O against float64 in the dims where V < 0. "
            "[bold]Σ δlp−δhp[/]: the shadow statistic the watch tracks, summed over rows.\n"
            "[bold]Reading it:[/] with several near-equal maxima, their P = exp(S - m) lie just "
            "below 1 and round [italic]up[/] to 1.0 in BF16 together, while the normaliser l is "
            "summed in float32; O comes out pushed towards V's sign (here negative), and "
            "δ = rowsum(dO∘O) is too large in every draw: the error the paper shows piling up "
            "in W_Q until training fails. The stabilized kernel shifts the softmax by more than "
            "the row maximum in those rows (paper Alg. 3), so no P sits just below 1: the bias "
            "drops to the control's level and δ's error changes sign from draw to draw."
        )


def main(*, draws: int = 8, seq: int = 256, device: str = "cpu", console: Optional[Console] = None) -> int:
    """Run the demo and print its table; returns the process exit code."""
    console = console or Console()
    backend = "CPU reference path" if device == "cpu" else f"on {device}"
    with console.status("measuring..."):
        rows = run(draws=draws, seq=seq, device=device)
    console.print(DemoTable(rows, backend=backend))
    return 0
