#!/usr/bin/env bash
# Issue 27: one arm of the paper-scale run (GPT-2 small, 524,288 tokens per step, `reproduce.py --preset paper`)
# on every GPU of the machine, in commands of at most 10 minutes while the machine stays held.
#
#   bash benchmarks/paper_scale.sh observe      # the watch observing (auto_switch=False)
#   bash benchmarks/paper_scale.sh switch       # the watch with auto_switch=True
#   bash benchmarks/paper_scale.sh observe 480 --micro-batch 64    # seconds of training, then train options
#
# Run the same command again and it resumes from the checkpoint on the machine's disk (runs/paper/, or
# $PAPER_ROOT): checkpoints never leave the machine, so an arm has to finish within one lease. Each command
# trains for SECONDS (default 480: a 600-second command also reads the corpus, checkpoints and bundles), then
# writes the launch root's summary, and, where $OUT is set, a bundle of it without checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
watch=${1:?usage: paper_scale.sh observe|switch [SECONDS] [train options]}
case $watch in observe|switch) ;; *) echo "paper_scale.sh: WATCH must be observe or switch, got '$watch'" >&2; exit 2;; esac
limit=${2:-480}
if ! [[ $limit =~ ^[0-9]+$ ]]; then
    echo "paper_scale.sh: SECONDS (the second argument) must be a whole number of seconds, got '$limit'" >&2; exit 2
fi
shift $(( $# < 2 ? $# : 2 ))
root=${PAPER_ROOT:-runs/paper}
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then echo "paper_scale.sh: no GPU on this machine" >&2; exit 2; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
rc=0
python -m torch.distributed.run --standalone --nproc_per_node "$gpus" benchmarks/reproduce.py train \
    --preset paper --out "$root/standard-$watch" --watch "$watch" --time-limit "$limit" "$@" || rc=$?
# what was written leaves the machine also when training failed
python benchmarks/reproduce.py summarize "$root" || true
if [ -n "${OUT:-}" ]; then
    python benchmarks/reproduce.py bundle "$root" "$OUT/paper-$watch.tar.xz" --every 10 || true
fi
exit $rc
