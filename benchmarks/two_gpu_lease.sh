#!/usr/bin/env bash
# Issue 45 over one device lease: benchmarks/two_gpu.sh detached from the device tool's calls, polled.
#
#   bash benchmarks/two_gpu_lease.sh [POLL_SECONDS]
#
# The first call on a fresh machine copies the package, benchmarks and examples to $LEASE_HOME/src (later calls re-send
# the working tree; the running job keeps its copy) and starts two_gpu.sh there under setsid. Every call (the first
# too) prints the parts' progress for POLL_SECONDS (default 480) or until the job has ended, and copies what the job
# wrote so far (logs, JSON, the examples' summaries and metrics.csv; no checkpoints) to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
poll=${1:-480}
if ! [[ $poll =~ ^[0-9]+$ ]]; then
    echo "two_gpu_lease.sh: POLL_SECONDS must be a whole number of seconds, got '$poll'" >&2; exit 2
fi
home=${LEASE_HOME:-/root/iw_two_gpu}
src=$home/src
res=$home/out
if [ ! -f "$home/launched" ]; then
    mkdir -p "$src" "$res"
    cp -r instability_watch benchmarks examples pyproject.toml "$src/"
    echo "launch $(date -u +%FT%TZ), uptime $(cut -d. -f1 /proc/uptime)s" | tee "$home/launched"
    setsid nohup bash -c "bash '$src/benchmarks/two_gpu.sh' '$res'; echo \$? > '$home/rc'" \
        > "$home/job.log" 2>&1 < /dev/null &
else
    echo "already launched: $(cat "$home/launched"); uptime $(cut -d. -f1 /proc/uptime)s"
fi
end=$(( SECONDS + poll ))
last=""
while [ ! -f "$home/rc" ] && [ $SECONDS -lt $end ]; do
    sleep 10
    now=$(tail -n 1 "$res/status.txt" 2>/dev/null)
    if [ "$now" != "$last" ]; then echo "$(cut -d. -f1 /proc/uptime)s  $now"; last=$now; fi
done
cat "$res/status.txt" 2>/dev/null
if [ -f "$home/rc" ]; then echo "job ended, rc $(cat "$home/rc")"; fi
if [ -n "${OUT:-}" ]; then
    (cd "$res" && find . -type f \( -name '*.json' -o -name '*.log' -o -name '*.txt' -o -name 'metrics.csv' \
        -o -name 'alerts.jsonl' \) -not -path '*/ckpt/*' -print0 | tar -czf "$OUT/two_gpu.tgz" --null -T -)
    cp "$res/status.txt" "$res/machine.txt" "$OUT/" 2>/dev/null
    for f in "$res"/*/results.json; do [ -f "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")_results.json"; done
fi
for f in "$res"/*.log; do
    [ -f "$f" ] && { echo "=== $(basename "$f")"; grep -v -i "warn" "$f" | tail -n 6; }
done
echo "uptime at the end of this call: $(cut -d. -f1 /proc/uptime)s"
