#!/usr/bin/env bash
# Build llama.cpp's own llama-bench, llama-server, llama-quantize and llama-imatrix from the llama.cpp
# sources vendored in the pinned llama-cpp-python sdist, so reference numbers come from exactly the code our engine runs.
# Usage: bench/build_llama_bench.sh [--check] [TOOL...]
#          TOOL: any of those four or ggml-rpc-server; default: the four; prints the llama-bench path on its last line (the folder of every tool).
#          --check builds nothing: prints that path and exits 0 if every TOOL is built, 1 if not.
# Env:   EDGECHAT_BENCH_CACHE  cache root (default ${XDG_CACHE_HOME:-~/.cache}/edgechat-bench): kept
#        between runs like pip's wheel cache, one build per pinned version shared by the test suite
#        (tests/conftest.py builds what it needs before the first test) and the benchmarks.
set -euo pipefail

check=0
if [[ ${1:-} == --check ]]; then
    check=1
    shift
fi

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=packaging/llama_sources.sh
source "$repo_root/packaging/llama_sources.sh"
ver="$(llama_pin "$repo_root")"

prefix="${EDGECHAT_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgechat-bench}/llama.cpp-$ver"
bin="$prefix/bin"
tools=("$@")
if [[ ${#tools[@]} == 0 ]]; then
    tools=(llama-bench llama-server llama-quantize llama-imatrix)
fi
all_built() {
    local tool
    for tool in "${tools[@]}"; do
        [[ -x "$bin/$tool" ]] || return 1
    done
}
if all_built; then
    echo "$bin/llama-bench"
    exit 0
fi
if [[ $check == 1 ]]; then
    echo "$bin/llama-bench"
    exit 1
fi

# One build at a time per cache (two test runs on one machine would otherwise share a build tree);
# whoever waited finds the tools the first one built.
mkdir -p "$prefix"
if command -v flock >/dev/null; then
    exec 9>"$prefix/.lock"
    flock 9
    if all_built; then
        echo "$bin/llama-bench"
        exit 0
    fi
fi

# The work tree lives in the cache, not /tmp, so an interrupted build resumes where it stopped.
work="$prefix/work"
llama_src="$(llama_sources "$work" "$ver")"

# Same configuration as llama-cpp-python's CPU source build: Release, shared libraries, curl off,
# GGML_NATIVE/OpenMP/llamafile at llama.cpp's defaults, plus the RPC backend: one build then also
# gives ggml-rpc-server and a libllama that reaches it (the RPC loopback test, packaging/GPU.md);
# RPC adds a backend to the registry and changes no CPU kernel. GGML_NATIVE is pinned ON because its default
# flips to OFF when SOURCE_DATE_EPOCH is set, and the reference must use the host's SIMD like the
# engine. The web UI is neither built (npm) nor downloaded: the build must work offline.
# $ORIGIN rpath: the binaries find the libllama/libggml copies installed next to them.
# shellcheck disable=SC2016  # $ORIGIN is for the loader, not the shell
cmake -S "$llama_src" -B "$work/build" "${cmake_generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON \
    -DGGML_RPC=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
    '-DCMAKE_INSTALL_RPATH=$ORIGIN' >&2
cmake --build "$work/build" --target "${tools[@]}" -j"$(nproc)" >&2

# Each file is copied under a temporary name and renamed into place, libraries first: a tool is
# there whole or not at all, and whatever runs from bin/ meanwhile (a test run beside this build)
# keeps working. Tools built earlier stay.
mkdir -p "$bin"
for file in "$work/build/bin/"*.so* "${tools[@]/#/$work/build/bin/}"; do
    name="$(basename "$file")"
    cp -a "$file" "$bin/.$name.tmp"
    mv -f "$bin/.$name.tmp" "$bin/$name"
done
# The build tree stays, so adding a tool later rebuilds only what changed.
rm -rf "$work/sdist"
echo "$bin/llama-bench"
