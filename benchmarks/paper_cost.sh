#!/usr/bin/env bash
# Issue 41, item 2: the watch's cost at the paper's scale: the paper preset unwatched (--watch off) and watched
# (--watch observe) on every GPU of the machine, one short run each, back to back in one device call.
#
#   bash benchmarks/paper_cost.sh [STEPS] [ORDER] [train options]
#   e.g. bash benchmarks/paper_cost.sh 400 off,observe      (then, in the next call on the same machine:)
#        bash benchmarks/paper_cost.sh 400 observe,off
#
# Each run trains STEPS steps from the same seed and data (the arms' settings: benchmarks/RESULTS.md, "The
# experiment's settings"), compiles anew, and reports steps/s after its first log step (compiling and the first
# probe done: status.json's steps_per_s_warm); the watched run probes every 10 steps as the arms do. Results
# accumulate in $COST_HOME/cost.jsonl over calls (one machine: later calls add rounds), and the table printed last
# gives every round so far, the median of each and the ratio watched / unwatched. Copies go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-400}
order=${2:-off,observe}
shift $(( $# < 2 ? $# : 2 ))
if ! [[ $steps =~ ^[0-9]+$ ]] || [ "$steps" -lt 100 ]; then
    echo "paper_cost.sh: STEPS (the first argument) must be a whole number >= 100, got '$steps'" >&2; exit 2
fi
home=${COST_HOME:-/root/iw_cost}
mkdir -p "$home/runs"
gpus=${IW_LEASE_NPROC:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for watch in ${order//,/ }; do
    case $watch in off|observe) ;; *) echo "paper_cost.sh: ORDER takes off and observe, got '$watch'" >&2; exit 2;; esac
    run=$home/runs/$watch-$(date -u +%H%M%S)
    t0=$SECONDS
    python -m torch.distributed.run --standalone --nproc_per_node "$gpus" benchmarks/reproduce.py train \
        --preset paper --arm standard --watch "$watch" --steps "$steps" --ckpt-every 0 --out "$run" "$@" \
        > "$run.log" 2>&1
    rc=$?
    python - "$run" "$watch" "$rc" "$((SECONDS - t0))" "$home/cost.jsonl" <<'EOF'
import glob, json, sys
run, watch, rc, wall, out = sys.argv[1:]
found = glob.glob(f"{run}/**/status.json", recursive=True)
status = json.load(open(found[0])) if found else {}
row = {"watch": watch, "rc": int(rc), "wall_s": int(wall), "run": run,
       **{k: status.get(k) for k in ("step", "steps_per_s", "steps_per_s_warm", "max_memory_gib", "device")}}
open(out, "a").write(json.dumps(row) + "\n")
print(f"{watch:8} rc {rc}  {row['step']} steps  {row['steps_per_s_warm']} steps/s warm  ({wall} s)")
EOF
done
python - "$home/cost.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
ok = [r for r in rows if r["rc"] == 0 and r["steps_per_s_warm"]]
for r in rows:
    print(f"{r['watch']:8} rc {r['rc']} {r['step']} steps {r['steps_per_s_warm']} steps/s warm {r['device']}")
by = {w: [r["steps_per_s_warm"] for r in ok if r["watch"] == w] for w in ("off", "observe")}
if by["off"] and by["observe"]:
    off, obs = statistics.median(by["off"]), statistics.median(by["observe"])
    print(f"median: unwatched {off:.3f}, watched {obs:.3f} steps/s; watched / unwatched {obs / off:.4f} "
          f"(rounds: {len(by['off'])} and {len(by['observe'])})")
EOF
if [ -n "${OUT:-}" ]; then cp "$home/cost.jsonl" "$OUT/"; cp "$home"/runs/*.log "$OUT/" 2>/dev/null; fi
