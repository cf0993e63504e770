#!/usr/bin/env bash
# Issue 43: bring flash-attn 4 (FA4, `flash_attn.cute`, pure Python over NVIDIA's CuTe DSL) to a lent GPU, see
# what of it runs there, and run the watch's FA4 tests against it. FA4's compiler library is a 92 MB wheel; a device
# call carries 64 MiB with the working tree (31 MB), so that wheel travels recompressed (xz, 64 MB) and cut in
# parts, with the other wheels, in three calls to the same warm machine.
#
#   bash benchmarks/fa4_contact.sh fetch    here: the loads into .whl/fa4_1, .whl/fa4_2, .whl/fa4_3 (~27 MB each;
#                                           recompressing takes ~3 minutes on 2 cores)
#   bash benchmarks/fa4_contact.sh stage    device calls 1 and 2, carry [".whl/fa4_1"], then [".whl/fa4_2"]: keeps
#                                           what came in $FA4_HOME/parts
#   bash benchmarks/fa4_contact.sh run      device call 3 (the machine still warm), carry [".whl/fa4_3"]: installs
#                                           into $FA4_HOME/site, then the parts in FA4_PARTS (default "tests
#                                           contact"; also "overhead"): the watch's FA4 tests
#                                           (tests/observe/test_flash_attn_gpu.py), benchmarks/fa4_contact.py, the
#                                           watch's cost on packed FA4 models (observer_overhead.py); logs in $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
home=${FA4_HOME:-/root/fa4}
big=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
case ${1:-} in
fetch)
    rm -rf .whl/fa4_1 .whl/fa4_2 .whl/fa4_3 .whl/fa4_dl && mkdir -p .whl/fa4_1 .whl/fa4_2 .whl/fa4_3 .whl/fa4_dl/x
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
    # the big wheel's files (its layout is what an install writes: a package folder and its dist-info) as tar.xz,
    # cut in 27 MB parts; the last part travels with the other wheels
    (cd .whl/fa4_dl/x && unzip -q "../$big")
    tar -C .whl/fa4_dl/x -cf - . | xz -9 -T0 > .whl/fa4_dl/libs.tar.xz
    rm -rf .whl/fa4_dl/x ".whl/fa4_dl/$big"
    dd if=.whl/fa4_dl/libs.tar.xz of=.whl/fa4_1/libs.tar.xz.part-aa bs=1000000 count=27 status=none
    dd if=.whl/fa4_dl/libs.tar.xz of=.whl/fa4_2/libs.tar.xz.part-ab bs=1000000 skip=27 count=27 status=none
    dd if=.whl/fa4_dl/libs.tar.xz of=.whl/fa4_3/libs.tar.xz.part-ac bs=1000000 skip=54 status=none
    sha256sum .whl/fa4_dl/libs.tar.xz | cut -d' ' -f1 > .whl/fa4_3/libs.tar.xz.sha256
    rm .whl/fa4_dl/libs.tar.xz && mv .whl/fa4_dl/*.whl .whl/fa4_3/ && rm -rf .whl/fa4_dl
    du -sh .whl/fa4_1 .whl/fa4_2 .whl/fa4_3
    ;;
stage)
    mkdir -p "$home/parts" && cp .whl/fa4_*/* "$home/parts/" && ls -la "$home/parts"
    ;;
run)
    mkdir -p "$home/parts" && cp .whl/fa4_*/* "$home/parts/"
    n=$(ls "$home"/parts/libs.tar.xz.part-* | wc -l)
    if [ "$n" -lt 3 ]; then
        echo "fa4_contact.sh: $n of 3 parts of the compiler library here (a fresh machine?): stage again" >&2; exit 2
    fi
    cat "$home"/parts/libs.tar.xz.part-* > "$home/libs.tar.xz"
    echo "$(cat "$home/parts/libs.tar.xz.sha256")  $home/libs.tar.xz" | sha256sum -c --quiet
    rm -rf "$home/site"
    # the small wheels first, in one install (several share the folder nvidia_cutlass_dsl), then the big one's files
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$home/site" \
        $(ls "$home"/parts/*.whl)
    tar -C "$home/site" -xJf "$home/libs.tar.xz"
    # what nvidia_cutlass_dsl_packages.pth does in a site-packages (a --target folder reads no .pth)
    export PYTHONPATH=$home/site/nvidia_cutlass_dsl/dsl_packages:$home/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    out=${OUT:-/tmp/fa4}
    mkdir -p "$out"
    set +e
    for part in ${FA4_PARTS:-tests contact}; do
        case $part in
            tests) timeout "${FA4_TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -rs \
                       tests/observe/test_flash_attn_gpu.py > "$out/fa4_tests.log" 2>&1
                   echo "fa4_tests rc $?" ;;
            contact) timeout "${FA4_CONTACT_S:-240}" python3 benchmarks/fa4_contact.py --dims "${FA4_DIMS:-128,64}" \
                         --json "$out/fa4_contact.json" > "$out/fa4_contact.log" 2>&1
                     echo "fa4_contact rc $?" ;;
            overhead) timeout "${FA4_OVERHEAD_S:-240}" python3 benchmarks/observer_overhead.py \
                          --models packed-fa4,packed-hf-fa4 --rounds 4 --kind-rounds 1 --json "$out/fa4_overhead.json" \
                          > "$out/fa4_overhead.log" 2>&1
                      echo "fa4_overhead rc $?" ;;
            *) echo "fa4_contact.sh: FA4_PARTS takes tests, contact and overhead, got '$part'" >&2 ;;
        esac
    done
    for f in fa4_contact fa4_overhead fa4_tests; do
        [ -f "$out/$f.log" ] && { echo "=== $f"; grep -v "Warning\|exe_args\|^resources" "$out/$f.log" | tail -n 20; }
    done
    ;;
*)
    echo "usage: fa4_contact.sh fetch | stage | run (got '${1:-}')" >&2; exit 2 ;;
esac
