#!/usr/bin/env bash
# Issue 41: one arm of the paper-scale run over one whole lease, training detached from the device tool's calls.
#
#   bash benchmarks/paper_lease.sh ARM WATCH [POLL_SECONDS] [train options]
#   e.g. bash benchmarks/paper_lease.sh standard switch 480
#
# ARM is reproduce.py's --arm (standard | control | kernel | stabilized), WATCH its --watch (observe | switch | switch_exact | clip_alert
# ...). The first call on a fresh machine copies the package, benchmarks and examples to $LEASE_HOME/src (so later calls,
# which re-send the working tree, cannot change the code under a running arm) and starts
# `reproduce.py train --preset paper` on every GPU under setsid, with a time limit of
# IW_LEASE_BUDGET (default 1800) seconds of device time, less the machine's uptime and IW_LEASE_TAIL (default 300)
# seconds for the stop, the bundle and the transfers. Every call (the first too) then prints progress for
# POLL_SECONDS (default 480) or until training has ended, and leaves in $OUT the training log, the summary and a
# bundle of the run (reproduce.py bundle: no checkpoints, report plots), so each call's return is a copy of
# everything so far. IW_STOP=1 asks the run to stop at its next log step (a file STOP in its directory).
# IW_LEASE_NO_LAUNCH=1 (for every call after the first): a call that finds no run (the machine was lost and a fresh
# one came) starts nothing and exits 3, instead of starting the arm again from step 0.
set -uo pipefail
cd "$(dirname "$0")/.."
arm=${1:?usage: paper_lease.sh ARM WATCH [POLL_SECONDS] [train options]}
watch=${2:?usage: paper_lease.sh ARM WATCH [POLL_SECONDS] [train options]}
poll=${3:-480}
shift $(( $# < 3 ? $# : 3 ))
if ! [[ $poll =~ ^[0-9]+$ ]]; then
    echo "paper_lease.sh: POLL_SECONDS (the third argument) must be a whole number of seconds, got '$poll'" >&2; exit 2
fi
home=${LEASE_HOME:-/root/iw_lease}
src=$home/src
root=$home/runs
run=$root/$arm-$watch
log=$home/train.log
budget=${IW_LEASE_BUDGET:-1800}
tail_s=${IW_LEASE_TAIL:-300}

if [ ! -f "$home/launched" ] && [ "${IW_LEASE_NO_LAUNCH:-0}" = 1 ]; then
    # a polling call that finds no run: the lease's machine was lost and this is a fresh one. An arm started again
    # here could not reach its horizon in what is left of the lease: say so and start nothing
    echo "paper_lease.sh: no run on this machine (uptime $(cut -d. -f1 /proc/uptime)s): the lease's machine was" \
         "lost; not launching again (IW_LEASE_NO_LAUNCH=1)" >&2
    exit 3
fi
if [ ! -f "$home/launched" ]; then
    gpus=${IW_LEASE_NPROC:-$(python -c "import torch; print(torch.cuda.device_count())")}  # NPROC: a CPU try-out
    if [ "$gpus" -lt 1 ]; then echo "paper_lease.sh: no GPU on this machine" >&2; exit 2; fi
    mkdir -p "$src" "$root"
    cp -r instability_watch benchmarks examples pyproject.toml "$src/"
    up=$(cut -d. -f1 /proc/uptime)
    limit=$(( budget - up - tail_s ))
    echo "launch $(date -u +%FT%TZ): $gpus GPUs, uptime ${up}s, training time limit ${limit}s"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo "$arm $watch $limit $*" > "$home/launched"
    setsid nohup bash -c "cd '$src' && PYTHONPATH='$src' python -m torch.distributed.run --standalone \
        --nproc_per_node $gpus benchmarks/reproduce.py train --preset paper --arm $arm --watch $watch \
        --out '$run' --time-limit $limit --ckpt-every 600 $*; echo \$? > '$home/rc'" \
        > "$log" 2>&1 < /dev/null &
else
    echo "already launched: $(cat "$home/launched"); uptime $(cut -d. -f1 /proc/uptime)s"
fi
if [ "${IW_STOP:-0}" = 1 ]; then mkdir -p "$run" && touch "$run/STOP" && echo "asked the run to stop"; fi

end=$(( SECONDS + poll ))
last=""
while [ ! -f "$home/rc" ] && [ $SECONDS -lt $end ]; do
    sleep 15
    line=$(grep -a '\] step ' "$log" 2>/dev/null | tail -n 1)
    if [ "$line" != "$last" ]; then echo "$(cut -d. -f1 /proc/uptime)s  $line"; last=$line; fi
done
echo "--- last lines of the training log:"
tail -n 6 "$log"
if [ -f "$home/rc" ]; then echo "training ended, rc $(cat "$home/rc")"; fi
if [ -n "${OUT:-}" ]; then
    cp "$log" "$OUT/train.log"
    (cd "$src" && PYTHONPATH="$src" python benchmarks/reproduce.py summarize "$root" > "$OUT/summary.txt" 2>&1)
    (cd "$src" && PYTHONPATH="$src" python benchmarks/reproduce.py bundle "$root" "$OUT/paper-$arm-$watch.tar.xz" \
        --every 10 2>&1 | tail -n 3)
    tail -n 2 "$OUT/summary.txt"
fi
echo "uptime at the end of this call: $(cut -d. -f1 /proc/uptime)s"
