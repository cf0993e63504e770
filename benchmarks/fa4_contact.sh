#!/usr/bin/env bash
# Issue 43: bring flash-attn 4 (FA4, `flash_attn.cute`, pure Python over NVIDIA's CuTe DSL) to a lent GPU and see
# what of it runs there, before the watch observes its functions. FA4's compiler library is a 92 MB wheel; a device
# call carries 64 MiB with the working tree (20 MB), so the wheels travel in three calls to the same warm machine.
#
#   bash benchmarks/fa4_contact.sh fetch    here: the wheels into .whl/fa4_1, .whl/fa4_2, .whl/fa4_3 (37 MB each)
#   bash benchmarks/fa4_contact.sh stage    device calls 1 and 2, carry [".whl/fa4_1"], then [".whl/fa4_2"]: keeps
#                                           what came in $FA4_HOME/parts
#   bash benchmarks/fa4_contact.sh run      device call 3 (the machine still warm), carry [".whl/fa4_3"]: joins the
#                                           parts, installs into $FA4_HOME/site, runs benchmarks/fa4_contact.py
set -euo pipefail
cd "$(dirname "$0")/.."
home=${FA4_HOME:-/root/fa4}
big=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
case ${1:-} in
fetch)
    rm -rf .whl/fa4_1 .whl/fa4_2 .whl/fa4_3 .whl/fa4_dl && mkdir -p .whl/fa4_1 .whl/fa4_2 .whl/fa4_3 .whl/fa4_dl
    plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64"
    plat="$plat --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    # versions as on the package index on 2026-11-27; --no-deps: each need named (the GPU image has torch,
    # typing_extensions and protobuf)
    for w in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
             nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 cuda-bindings==13.5.0 \
             quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
            -d .whl/fa4_dl "$w"
    done
    # three loads of ~36.9 MB each (110.6 MB of wheels), each beside the 27 MB working tree under the 64 MiB a call
    head -c 28500000 ".whl/fa4_dl/$big" > ".whl/fa4_1/$big.part-aa"
    tail -c +28500001 ".whl/fa4_dl/$big" | head -c 26600000 > ".whl/fa4_2/$big.part-ab"
    tail -c +55100001 ".whl/fa4_dl/$big" > ".whl/fa4_3/$big.part-ac" && rm ".whl/fa4_dl/$big"
    mv .whl/fa4_dl/cuda_bindings-*.whl .whl/fa4_1/ && mv .whl/fa4_dl/*.whl .whl/fa4_2/
    rm -rf .whl/fa4_dl
    du -sh .whl/fa4_1 .whl/fa4_2 .whl/fa4_3
    ;;
stage)
    mkdir -p "$home/parts" && cp .whl/fa4_*/* "$home/parts/" && ls -la "$home/parts"
    ;;
run)
    mkdir -p "$home/parts" && cp .whl/fa4_*/* "$home/parts/"
    n=$(ls "$home/parts/$big".part-* | wc -l)
    if [ "$n" -lt 3 ]; then
        echo "fa4_contact.sh: $n of 3 parts of $big here (a fresh machine?): stage again" >&2; exit 2
    fi
    cat "$home/parts/$big".part-* > "$home/$big"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$home/site" \
        "$home/$big" $(ls "$home"/parts/*.whl)
    export PYTHONPATH=$home/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    python3 benchmarks/fa4_contact.py --json "${OUT:-/tmp}/fa4_contact.json"
    ;;
*)
    echo "usage: fa4_contact.sh fetch | stage | run (got '${1:-}')" >&2; exit 2 ;;
esac
