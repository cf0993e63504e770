#!/bin/bash
# Session 16's device run, detached: tests in parallel, then the timed benchmarks one at a time.
R=/tmp/s16; mkdir -p $R; ROOT=$PWD
log() { echo "$(date -u +%H:%M:%S) $*" >> $R/status.txt; }
{ nvidia-smi -L; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $R/device.txt 2>&1
log start
export PYTHONPATH=$ROOT
python -m pytest -m gpu --co -q tests/kernels/test_triton_gpu.py 2>/dev/null | grep '::' > $R/triton_ids.txt
for i in 0 1 2; do awk -v i=$i 'NR%3==i' $R/triton_ids.txt > $R/ids_$i.txt; done
pids=()
(python -m pytest -m gpu -q -rf tests/observe/test_entry_points_gpu.py > $R/A_main_entry_points.txt 2>&1; echo "rc $?" >> $R/A_main_entry_points.txt) & pids+=($!)
for i in 0 1 2; do
  (python -m pytest -m gpu -q -rf $(cat $R/ids_$i.txt) > $R/A_main_triton_$i.txt 2>&1; echo "rc $?" >> $R/A_main_triton_$i.txt) & pids+=($!)
done
(cd build/branches/prepass-once && PYTHONPATH=$PWD python -m pytest -m gpu -q -rf tests/kernels/test_triton_gpu.py tests/observe/test_entry_points_gpu.py -k "mask or switched or fast_launch" > $R/A_prepass_tests.txt 2>&1; echo "rc $?" >> $R/A_prepass_tests.txt) & pids+=($!)
wait "${pids[@]}"
log tests done
(cd build/branches/prepass-once && PYTHONPATH=$PWD python benchmarks/flex_switch_speed.py --rounds 3 --json $R/B_prepass.json > $R/B_prepass.txt 2>&1; echo "rc $?" >> $R/B_prepass.txt)
log B done
python benchmarks/flex_switch_speed.py --rounds 1 --sweep dq --sweep fwd --json $R/C_sweep.json > $R/C_sweep.txt 2>&1; echo "rc $?" >> $R/C_sweep.txt
log C done
cd build/branches/stats-runs && export PYTHONPATH=$PWD
for m in off on; do
  python benchmarks/observer_overhead.py --models packed-flex --rounds 8 --kind-rounds 4 --mask-runs $m --json $R/D_runs_$m.json > $R/D_runs_$m.txt 2>&1; echo "rc $?" >> $R/D_runs_$m.txt
  log D $m done
done
touch $R/done
