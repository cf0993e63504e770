"""benchmarks/fsdp1_sigma.py on CPU: 2 gloo processes, FSDP1 per block, both ways of reading W_Q give the same
Grams (the script exits 1 otherwise)."""
import json
import sys

from helpers import REPO, child_env, run_process


def test_fsdp1_sigma_script_compares_both_paths(tmp_path):
    out = tmp_path / "r.json"
    proc = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(REPO / "benchmarks" / "fsdp1_sigma.py"), "--layers", "2", "--reps", "2", "--json",
                        str(out)], env=child_env(tmp_path), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["world"] == 2 and r["layers"] == 2 and r["max_rel_diff"] < 1e-6
    assert r["whole_params_ms"] > 0 and r["unit_gathers_ms"] > 0
    assert "grams() whole_params" in proc.stdout
