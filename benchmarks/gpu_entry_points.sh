#!/usr/bin/env bash
# Issue 43's GPU checks: the entry-point GPU tests (and issue 41's check that a compiled switched head loses its
# bias), the speed of our kernels over packed documents against varlen_attn and of switched flex calls against
# compiled FlexAttention (each profiled: a kernel table per variant), the watch's cost on packed models, and a sweep
# of the backward kernels' launch configs on the packed call. Each part has its own time limit; logs and JSON go to
# $OUT; a short table of the parts run comes last. All parts take up to about 26 minutes, more than one device
# call (10): run them in calls of up to 8 minutes on one warm machine,
#
#   IW_EP_PARTS="tests varlen" bash benchmarks/gpu_entry_points.sh      (8 minutes at most)
#   IW_EP_PARTS="flex" bash benchmarks/gpu_entry_points.sh              (6 minutes at most)
#   IW_EP_PARTS="overhead" bash benchmarks/gpu_entry_points.sh          (7 minutes at most; with a kernel table of
#                                                                        one ordinary and one probe step a model;
#                                                                        packed flex also with --flex-stats flex)
#   IW_EP_PARTS="sweep" bash benchmarks/gpu_entry_points.sh             (7 minutes at most)
#
# (default: all five, in this order; IW_SWEEP_S and IW_OVERHEAD_S change those parts' limits).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/gpu_entry_points}
parts=${IW_EP_PARTS:-tests varlen flex overhead sweep}
for p in $parts; do
    case $p in
        tests|varlen|flex|overhead|sweep) ;;
        *) echo "gpu_entry_points.sh: IW_EP_PARTS takes tests, varlen, flex, overhead and sweep, got '$p'" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
run() {  # name, seconds, command...
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$out/$name.log" 2>&1
    echo "$name rc $? ($((SECONDS - t0)) s)" | tee -a "$out/status.txt"
}
for p in $parts; do
    case $p in
        tests) run tests 240 python -m pytest -q -p no:cacheprovider tests/observe/test_entry_points_gpu.py \
                   tests/observe/test_switch_acts.py tests/callbacks/test_hf_trainer_gpu.py \
                   "tests/observe/test_compile.py::test_blocks_compiled_one_by_one_on_gpu_with_inductor" -rs ;;
        varlen) run varlen_speed 240 python benchmarks/varlen_speed.py --rounds 3 --json "$out/varlen_speed.json" \
                    --profile "$out/profile" ;;
        flex) run flex_switch_speed 360 python benchmarks/flex_switch_speed.py --rounds 3 \
                  --json "$out/flex_switch_speed.json" --profile "$out/profile" ;;
        overhead)  # packed flex twice: SDPA's passes over its mask (the default), then FlexAttention's passes
            run overhead "${IW_OVERHEAD_S:-200}" python benchmarks/observer_overhead.py \
                --models "${IW_OVERHEAD_MODELS:-packed-flex,packed-varlen}" --rounds 2 --kind-rounds 1 \
                --json "$out/overhead.json" --profile "$out/profile"
            run overhead_flex "${IW_OVERHEAD_S:-200}" python benchmarks/observer_overhead.py --models packed-flex \
                --rounds 2 --kind-rounds 1 --flex-stats flex --json "$out/overhead_flex.json" \
                --profile "$out/profile" ;;
        sweep) run varlen_sweep "${IW_SWEEP_S:-420}" python benchmarks/varlen_speed.py --rounds 1 --sweep dkdv \
                   --sweep dq --json "$out/varlen_sweep.json" ;;
    esac
done
[ -f "$out/tests.log" ] && { echo "=== tests"; tail -n 15 "$out/tests.log"; }
[ -f "$out/varlen_speed.log" ] && { echo "=== varlen_speed"; grep -h "^profile" "$out/varlen_speed.log"
    grep -v "^profile\|^resources" "$out/varlen_speed.log" | tail -n 11; grep -h "^resources" "$out/varlen_speed.log"; }
[ -f "$out/flex_switch_speed.log" ] && { echo "=== flex_switch_speed"; grep -h "^profile" "$out/flex_switch_speed.log"
    grep -v "^profile\|^resources" "$out/flex_switch_speed.log" | tail -n 23
    grep -h "^resources" "$out/flex_switch_speed.log" | grep -v "spills=0 " | head -n 20; }
for f in overhead overhead_flex; do
    [ -f "$out/$f.log" ] && { echo "=== $f"; grep -h "profile, " "$out/$f.log"; grep -v "profile, " "$out/$f.log" |
        tail -n 8; }
done
[ -f "$out/varlen_sweep.log" ] && { echo "=== varlen_sweep"; grep -h "^sweep " "$out/varlen_sweep.log" ||
    tail -n 30 "$out/varlen_sweep.log"; }  # cut short: the configs timed so far
echo "=== status"; cat "$out/status.txt"
# the profiles as one file (the device tool brings back a limited number of files)
if [ -d "$out/profile" ]; then tar -czf "$out/profiles.tgz" -C "$out" profile && rm -rf "$out/profile"; fi
