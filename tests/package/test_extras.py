"""The package without its optional frameworks: the engine, a plain loop, the console, the run directory and
the report need neither Lightning nor transformers; the callbacks say which extra to install."""
from __future__ import annotations

import subprocess
import sys

from helpers import REPO, child_env

# Lightning and transformers made unimportable in a fresh interpreter (as where they are not installed).
BLOCK = ("import sys\n"
         "for name in ('lightning', 'lightning.pytorch', 'pytorch_lightning', 'transformers', 'accelerate'):\n"
         "    sys.modules[name] = None\n")


def _run(code: str, tmp_path):
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=300,
                          env=child_env(tmp_path), cwd=tmp_path)


def test_the_core_runs_without_lightning_or_transformers(tmp_path):
    code = (
        "import torch\n"
        "from instability_watch import InstabilityWatch, WatchConfig, load_run\n"
        "from instability_watch.outputs.console import ConsoleReporter\n"
        "from instability_watch.outputs.rundir import RunWriter\n"
        "from instability_watch.outputs import report\n"
        "from nanogpt import GPT, GPTConfig\n"
        "torch.manual_seed(0)\n"
        "model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))\n"
        "writer = RunWriter('run')\n"
        "watch = InstabilityWatch(model, WatchConfig(probe_every=1, log_every=2), listeners=[ConsoleReporter(), writer])\n"
        "writer.open(watch)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for i in range(4):\n"
        "    x = torch.randint(0, 64, (2, 16))\n"
        "    _, loss = model(x, x)\n"
        "    loss.backward(); opt.step(); opt.zero_grad()\n"
        "    watch.step(loss)\n"
        "watch.detach(); writer.close()\n"
        "run = load_run('run')\n"
        "assert sorted(run.metrics['step'].unique().tolist()) == [1, 2, 3, 4], run.metrics['step'].unique()\n"
        "assert report.main('run', plots=False) == 0\n"
        "assert 'lightning' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    proc = _run(code, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_a_missing_extra_names_what_to_install(tmp_path):
    for imp, extra in (("from instability_watch import InstabilityWatchCallback", "instability_watch[lightning]"),
                       ("from instability_watch.callbacks import InstabilityWatchCallback", "instability_watch[lightning]"),
                       ("from instability_watch.callbacks.hf import InstabilityWatchTrainerCallback",
                        "instability_watch[hf]")):
        proc = _run(imp + "\n", tmp_path)
        assert proc.returncode != 0 and "ImportError" in proc.stderr and extra in proc.stderr, (imp, proc.stderr[-2000:])


def test_the_package_declares_lightning_as_an_extra():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("lightning") for d in meta["dependencies"])
    assert meta["optional-dependencies"]["lightning"] == ["lightning>=2.4"]
