#!/usr/bin/env bash
# Issue 45: every multi-GPU driver on the GPUs of one machine (2 by default), one after the other, logs and JSON under
# OUT (default runs/two_gpu). The settings are fixed here, before a run; RESULTS.md quotes them.
#
#   bash benchmarks/two_gpu.sh [OUT]          (or detached over a device lease: benchmarks/two_gpu_lease.sh)
#   IW_PARTS="hf gpt2" bash benchmarks/two_gpu.sh    (these parts, in this order; default: example llama gpt2 hf sigma)
#
# gpt2: multi_gpu.py, gpt2-small: ddp, fsdp2, fsdp1; IW_GPT2_ROUNDS (default 1; 5 on 2026-11-27) rounds of an
#    unwatched and a watched fit (order alternating), 220 steps each, timed from step 20, with each step's duration
#    (the watch's cadence: the defaults); one fit in blocks of 200 steps, 3 pairs of a watched and an unwatched block
#    after a warm-up block (1,400 steps); sigma against float64; a checkpoint at step 60 (a deciding watch, every 5
#    steps) resumed; ranks compared.
# hf: hf_trainer_multi_gpu.py under torchrun: IW_HF_ROUNDS (default 2; 5 on 2026-11-27) rounds of 250 steps timed
#    from 50, batch 16 a device, and a run in blocks as above; the same checks.
# example: examples/train_gpt2.py --preset gpt2-small --devices N with each strategy (ddp, fsdp, fsdp2), watched,
#    150 steps.
# sigma: the spectral read on sharded weights, timed: fsdp1_sigma.py (FSDP1: one all-reduce or per-unit gathers) and
#    sharded_sigma.py (FSDP2: gather W or the Grams), GPT-2 small's shapes, torchrun over the GPUs.
# llama: multi_gpu.py, llama-1b: ddp, fsdp2, fsdp1; 2 rounds (3 until 2026-11-28) of 60 steps timed from 10;
#    checkpoint at 52.
# Each part has a time limit (IW_PART_S, default 900 s); a part cut short keeps what it wrote (results.json after
# every case). status.txt gets one line per part.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1
# NVLink multicast stays off (the lent machines' rule; the variables are set there, kept here for other launches)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${1:-runs/two_gpu}
n=${IW_DEVICES:-2}
part_s=${IW_PART_S:-900}
parts=${IW_PARTS:-example llama gpt2 hf sigma}
for p in $parts; do
    case $p in
        gpt2|hf|example|llama|sigma) ;;
        *) echo "two_gpu.sh: IW_PARTS takes sigma, gpt2, hf, example and llama, got '$p'" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -n 4
    python -c "import torch, lightning, transformers as t
print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', t.__version__,
      'nccl', torch.cuda.nccl.version())"
} > "$out/machine.txt" 2>&1
part() {  # name, command...
    local name=$1; shift
    local t0=$SECONDS
    echo "$(date -u +%T) start $name" >> "$out/status.txt"
    timeout "$part_s" "$@" > "$out/$name.log" 2>&1
    local rc=$?  # before anything else: a command substitution would reset it
    echo "$(date -u +%T) $name rc $rc ($((SECONDS - t0)) s)" >> "$out/status.txt"
}
gpt2() {
    part gpt2 python benchmarks/multi_gpu.py --devices "$n" --models gpt2-small --rounds "${IW_GPT2_ROUNDS:-1}" \
        --steps 220 --skip 20 --pairs 3 --ckpt-step 60 --out "$out/gpt2"
}
hf() {
    part hf python -m torch.distributed.run --standalone --nproc_per_node "$n" benchmarks/hf_trainer_multi_gpu.py \
        --rounds "${IW_HF_ROUNDS:-2}" --steps 250 --skip 50 --batch 16 --pairs 3 --out "$out/hf"
}
example() {
    for s in ddp fsdp fsdp2; do
        part "example_$s" python examples/train_gpt2.py --preset gpt2-small --devices "$n" --strategy "$s" \
            --steps 150 --no-checkpoint --no-live-table --out "$out/example_$s"
    done
}
sigma() {
    local part_s=150  # each: seconds of work; a hang must not eat the lease
    part fsdp1_sigma python -m torch.distributed.run --standalone --nproc_per_node "$n" benchmarks/fsdp1_sigma.py \
        --json "$out/fsdp1_sigma.json"
    part sharded_sigma python -m torch.distributed.run --standalone --nproc_per_node "$n" benchmarks/sharded_sigma.py \
        --json "$out/sharded_sigma.json"
}
llama() {
    part llama python benchmarks/multi_gpu.py --devices "$n" --models llama-1b --rounds 2 --steps 60 --skip 10 \
        --ckpt-step 52 --out "$out/llama"
}
for p in $parts; do $p; done
echo "$(date -u +%T) done" >> "$out/status.txt"
