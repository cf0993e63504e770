"""The main job of this milestone: `instability-watch demo`, and the CLI around it."""
import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from instability_watch import cli, demo

ROOT = Path(__file__).resolve().parents[1]


def test_demo_measures_the_bias_and_the_fix():
    rows = demo.run(draws=3, seq=128)
    control, standard, stabilized = rows
    assert control.multi_max_frac == 0.0 and standard.multi_max_frac == 1.0
    assert standard.o_bias < 0 and abs(standard.o_bias) > 5 * abs(control.o_bias)
    assert abs(stabilized.o_bias) * 5 < abs(standard.o_bias)
    assert standard.delta_positive_draws == 3


def test_demo_prints_a_table():
    out = io.StringIO()
    assert demo.main(draws=2, seq=64, console=Console(file=out, width=100)) == 0
    text = out.getvalue()
    for needle in ("1 maximum", "4 near-tied", "standard", "stabilized", "O bias", "Σ δlp−δhp", "2/2"):
        assert needle in text, needle


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--draws", "0"])
    assert exc.value.code == 2
    assert "must be a positive integer, got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([])


def test_ci_runs_exactly_the_readme_test_command():
    """.ci/run extracts and runs the README's test command; both must stay in sync."""
    readme = (ROOT / "README.md").read_text()
    script = (ROOT / ".ci" / "run").read_text()
    assert "<!-- ci: tests -->" in readme and "<!-- main job -->" in readme
    cmd = subprocess.run(
        ["bash", "-c", 'source <(sed -n "/^extract()/,/^}/p" .ci/run); extract'],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert "pytest" in cmd and "torch==2.13.0" in cmd
    assert cmd in readme
    assert "extract" in script


def test_module_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "instability_watch.cli", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0 and "demo" in out.stdout
