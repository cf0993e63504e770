"""The main job of this milestone: `instability-watch demo`, and the CLI around it."""
import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from instability_watch import cli, demo

from helpers import REPO

ROOT = REPO


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


# -- issue 21, item 7: the demo on cuda, its --seq range, and a reading computed from the numbers


def _one_error_line(capsys, argv):
    """Run the CLI on ``argv``, expect a parse error: status 2 and exactly one stderr line, returned."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "_positive_int" not in err and "invalid" not in err, err
    return lines[0]


def test_demo_runs_at_the_smallest_seq():
    control, standard, stabilized = demo.run(draws=1, seq=demo.MIN_SEQ)
    assert standard.seq == demo.MIN_SEQ and standard.multi_max_frac == 1.0 and control.multi_max_frac == 0.0


@pytest.mark.parametrize("seq", ["3", "0", "-1", str(demo.MAX_SEQ + 1), "x", "64.0"])
def test_cli_rejects_seq_out_of_range(seq, capsys):
    line = _one_error_line(capsys, ["demo", "--seq", seq])
    assert line.startswith("instability-watch demo: error: argument --seq: ")
    assert f"from {demo.MIN_SEQ} to {demo.MAX_SEQ}" in line and f"got {seq!r}" in line


def test_demo_run_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"seq must be an integer from 4 .* got 3"):
        demo.run(seq=3)
    with pytest.raises(ValueError, match="draws must be a positive integer, got 0"):
        demo.run(draws=0)
    with pytest.raises(ValueError, match="device: must be 'cpu', 'cuda' or 'cuda:N', got 'foo'"):
        demo.run(device="foo")


@pytest.mark.parametrize("device", ["foo", "mps", "cuda:x", "meta"])
def test_cli_rejects_a_bad_device(device, capsys):
    line = _one_error_line(capsys, ["demo", "--device", device])
    assert line == f"instability-watch demo: error: argument --device: must be 'cpu', 'cuda' or 'cuda:N', got {device!r}"


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_cli_device_cuda_without_cuda(device, capsys, monkeypatch):
    """Without CUDA (as here, or with the CPU build of PyTorch on a GPU machine): one line, before any work."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _one_error_line(capsys, ["demo", "--device", device])
    assert line.startswith("instability-watch demo: error: argument --device: CUDA is not available on this machine")
    assert line.endswith(f"available: cpu; got {device!r}")


def test_cli_device_cuda_without_cuda_in_a_process():
    """Through the real entry point, CUDA hidden (no GPU here; on a GPU machine, CUDA_VISIBLE_DEVICES='')."""
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "instability_watch.cli", "demo", "--device", "cuda"],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("instability-watch demo: error: argument --device: CUDA is not available on this machine")


@pytest.mark.gpu
def test_demo_on_cuda(capsys):
    import torch

    rows = demo.run(draws=2, seq=128, device="cuda")
    control, standard, stabilized = rows
    # the Triton kernel counts ties on a sample of the tiles: the fraction is over the sampled rows
    assert control.multi_max_frac == 0.0 and standard.multi_max_frac == 1.0 and stabilized.multi_max_frac == 1.0
    a = demo.assess(rows)
    assert a.shows_bias and a.fix_removes, rows
    assert cli.main(["demo", "--device", "cuda", "--draws", "2", "--seq", "128"]) == 0
    out = capsys.readouterr().out
    assert f"on cuda:{torch.cuda.current_device()}" in out and "Reading it" in out
    line = _one_error_line(capsys, ["demo", "--device", f"cuda:{torch.cuda.device_count()}"])
    assert "no such GPU on this machine" in line


def _rows(seq, draws, control, standard, stabilized):
    """DemoRows for (o_bias in 1e-5, delta_err_mean, delta_positive_draws, o_negative_draws) per case."""
    cases = [("1 maximum", "standard", 0.0), ("4 near-tied", "standard", 1.0), ("4 near-tied", "stabilized", 1.0)]
    return [
        demo.DemoRow(case=case, kernel=kernel, multi_max_frac=tied, o_bias=bias * 1e-5, delta_err_mean=delta,
                     delta_positive_draws=pos, o_negative_draws=neg, draws=draws, seq=seq)
        for (case, kernel, tied), (bias, delta, pos, neg) in zip(cases, (control, standard, stabilized))
    ]


def _render(rows):
    out = io.StringIO()
    Console(file=out, width=400).print(demo.DemoTable(rows, backend="test"))
    return " ".join(out.getvalue().split())


def test_reading_explains_the_bias_when_the_rows_show_it():
    # the README's seq-256 numbers
    rows = _rows(256, 8, (+0.34, -0.163, 1, 3), (-9.86, +3.234, 8, 8), (+0.14, -0.114, 3, 4))
    a = demo.assess(rows)
    assert a.shows_bias and a.fix_removes
    text = _render(rows)
    assert "O bias is -9.86e-5 (negative in 8/8 draws), 29.0× the 1-maximum control's" in text
    assert "positive in 8/8 draws" in text and "round up to 1.0 in BF16 together" in text
    assert "1% of the standard kernel's and 0.4× the control's, back at the control's level" in text
    assert "below the noise" not in text and "does not remove" not in text


def test_reading_says_when_the_effect_is_below_the_noise():
    # measured at seq 4096: the near-tied rows look like the control
    rows = _rows(4096, 8, (-1.83, +9.567, 6, 5), (+1.55, -8.217, 2, 3), (+2.40, -12.693, 2, 2))
    assert not demo.assess(rows).shows_bias
    text = _render(rows)
    assert "at seq 4096 with 8 draws the effect is below the noise" in text
    assert "O bias is +1.55e-5 (negative in 3/8 draws), 0.8× the 1-maximum control's" in text
    assert "here neither holds" in text and "--seq 256" in text
    assert "round up to 1.0" not in text and "no P sits just below 1" not in text


def test_reading_needs_every_test_to_claim_the_bias():
    # a large ratio from a small control mean, but the draws disagree in sign: not clear
    rows = _rows(2048, 4, (+0.05, -0.1, 2, 2), (-1.0, +2.0, 4, 2), (+0.1, -0.1, 2, 2))
    a = demo.assess(rows)
    assert a.bias_ratio >= demo.CLEAR_RATIO and not a.bias_clear and a.delta_positive
    text = _render(rows)
    assert "the numbers do not show the effect clearly" in text and "here only the second holds" in text
    assert "more --draws (default 8)" in text


def test_reading_says_when_the_fix_does_not_remove_the_bias():
    rows = _rows(256, 8, (+0.34, -0.163, 1, 3), (-9.86, +3.234, 8, 8), (-6.0, +2.0, 8, 8))
    a = demo.assess(rows)
    assert a.shows_bias and not a.fix_removes
    text = _render(rows)
    assert "The stabilized kernel does not remove it here: its O bias is -6.00e-5, 61% of the standard kernel's" in text


# -- issue 21, item 8 (CLI half): option errors, --out, --version


@pytest.mark.parametrize(
    "argv, option, given",
    [
        (["demo", "--draws", "abc"], "--draws", "abc"),
        (["demo", "--draws", "-2"], "--draws", "-2"),
        (["report", "RUN", "--top", "x"], "--top", "x"),
        (["report", "RUN", "--top", "0"], "--top", "0"),
    ],
)
def test_option_errors_name_the_option_what_is_allowed_and_what_was_given(argv, option, given, capsys):
    line = _one_error_line(capsys, argv)
    assert f"error: argument {option}: must be a positive integer, got {given!r}" in line


def test_a_missing_command_names_the_commands(capsys):
    assert _one_error_line(capsys, []) == "instability-watch: error: a command is required: 'demo' or 'report', got none"


def test_report_out_must_not_be_a_file(tmp_path, capsys):
    a_file = tmp_path / "plots.png"
    a_file.write_text("x")
    for out in (a_file, a_file / "sub"):
        line = _one_error_line(capsys, ["report", str(tmp_path / "no-run"), "--out", str(out)])
        assert line.startswith("instability-watch report: error: argument --out: must be a directory")
        assert f"got {str(out)!r}" in line and ("an existing file" in line or f"inside the file {str(a_file)!r}" in line)


def _unwritable_dir(tmp_path):
    """A directory this process cannot create files in: a read-only one, or under /sys for root."""
    import os
    import stat

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    for candidate in (ro, Path("/sys")):
        try:
            (candidate / ".instability-watch-test").touch()
        except OSError:
            return candidate
        os.unlink(candidate / ".instability-watch-test")
    pytest.skip("no unwritable directory found (root on a filesystem that lets root write anywhere)")


def test_report_out_must_be_writable(tmp_path, capsys):
    unwritable = _unwritable_dir(tmp_path)
    try:
        for out, where in ((unwritable, "which"), (unwritable / "plots" / "a", f"to be created in {str(unwritable)!r}, which")):
            line = _one_error_line(capsys, ["report", str(tmp_path / "no-run"), "--out", str(out)])
            assert line.startswith("instability-watch report: error: argument --out: must be a directory")
            assert f"got {str(out)!r}, {where} is not writable" in line, line
    finally:
        (tmp_path / "ro").chmod(0o755)


def test_report_out_accepts_a_new_directory_without_creating_it(tmp_path):
    out = tmp_path / "a" / "b"
    assert cli._out_dir(str(out)) == str(out)
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []


def test_version(capsys):
    import importlib.metadata

    import instability_watch

    # in this process (test_module_entry_point runs `python -m instability_watch.cli` in its own)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code in (0, None)
    assert capsys.readouterr().out == f"instability-watch {instability_watch.__version__}\n"
    # __version__ and the installed metadata (pyproject.toml's version) must not drift apart
    try:
        installed = importlib.metadata.version("instability_watch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("instability_watch is not installed")
    assert installed == instability_watch.__version__
