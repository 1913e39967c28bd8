#!/bin/sh
# overlay1's extension (recipes.md §12): vLLM's _C_stable_libtorch rebuilt for sm_121a from the pinned tree.
#   usage: build-stable-ext.sh VLLM_TREE CONTEXT OUT        (in the build stage of images/vllm/Dockerfile)
#
# The recipe's own script (tonyd2wild build/build_stable_ext.sh) is UNKNOWN. What is known of it: it runs vLLM's
# CMake in a container of the base image on the FULL checkout (CMakeLists.txt, cmake/, csrc/), with cmake and
# ninja added, and yields build/_C_stable_libtorch*.so, which is copied into the vllm package; "the branch's kernel
# changes all live in that one extension" (GFTR-Technology/DeepSeek-V4.1-Flash-vLLM-DGX-Spark-4x-6x@20b7e414
# scripts/build-image.sh; im0xMagnus/deepseek-v4.1-flash-uncensored-8x-dgx-spark@45e0a8fe build/build_all.sh).
# The configure below is vLLM's documented CMake entry (VLLM_PYTHON_EXECUTABLE, VLLM_TARGET_DEVICE) building that one
# target. Differences forced by builder: no network (the recipe's build container had it), so cmake and ninja must
# already be in the base, and every dependency vLLM's CMake would download must be pinned as a source named
# vllm-fetch-<name> (laid out at CONTEXT/src-vllm-fetch-<name>/), handed to CMake as FETCHCONTENT_SOURCE_DIR_<NAME>.
# Environment: TORCH_CUDA_ARCH_LIST (12.1a), EXT_BUILD_JOBS.
set -eu
tree=$1 ctx=$2 out=$3
die() { echo "build-stable-ext: $*" >&2; exit 1; }

arch=${TORCH_CUDA_ARCH_LIST:?TORCH_CUDA_ARCH_LIST is not set}
test -f "$tree/CMakeLists.txt" && test -d "$tree/csrc" || die "$tree is not a full vLLM tree (no CMakeLists.txt or csrc/)"
for t in cmake ninja; do
    command -v "$t" >/dev/null 2>&1 || die "$t is not in the base image, and the build has no network to install it"
done
nvcc=$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)
test -x "$nvcc" || die "no nvcc in the base image (PATH or /usr/local/cuda/bin)"
command -v cuobjdump >/dev/null 2>&1 || PATH="$PATH:$(dirname "$nvcc")"
command -v cuobjdump >/dev/null 2>&1 || die "no cuobjdump beside $nvcc: cannot check the extension's SASS"

# each pinned FetchContent dependency: CMake upper-cases the declared name; a name with "-" may stand for "_"
# (source names cannot hold "_"), so both spellings are given (the unused one is only a CMake warning)
set --
for d in "$ctx"/src-vllm-fetch-*; do
    [ -d "$d" ] || continue
    n=$(printf '%s' "${d##*/src-vllm-fetch-}" | tr 'a-z.' 'A-Z_')
    set -- "$@" "-DFETCHCONTENT_SOURCE_DIR_$n=$d"
    case "$n" in *-*) set -- "$@" "-DFETCHCONTENT_SOURCE_DIR_$(printf '%s' "$n" | tr '-' '_')=$d" ;; esac
    echo "build-stable-ext: FetchContent ${d##*/src-vllm-fetch-} <- $d"
done

build=/build/ext-build
TORCH_CUDA_ARCH_LIST=$arch cmake -S "$tree" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DVLLM_TARGET_DEVICE=cuda -DVLLM_PYTHON_EXECUTABLE="$(command -v python3)" -DCMAKE_CUDA_COMPILER="$nvcc" "$@" \
    || die "vLLM's CMake configure failed (a dependency it downloads must be pinned as sources.vllm-fetch-<name>)"
TORCH_CUDA_ARCH_LIST=$arch cmake --build "$build" --target _C_stable_libtorch -j "${EXT_BUILD_JOBS:-20}" \
    || die "building _C_stable_libtorch failed"

found=$(find "$build" -name '_C_stable_libtorch*.so' -type f | sort)
[ "$(printf '%s\n' "$found" | grep -c .)" = 1 ] || die "want one _C_stable_libtorch*.so in $build, found: ${found:-none}"
sm="sm_$(printf '%s' "$arch" | tr -d '.')"
cuobjdump --list-elf "$found" | grep -q "$sm" || die "$found carries no $sm SASS"
mkdir -p "$out"
cp -p "$found" "$out/"
echo "build-stable-ext: $out/${found##*/} ($sm)"
