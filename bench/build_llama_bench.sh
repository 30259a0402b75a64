#!/usr/bin/env bash
# Build llama.cpp's own llama-bench, llama-server, llama-quantize and llama-imatrix from the llama.cpp
# sources vendored in the pinned llama-cpp-python sdist, so reference numbers come from exactly the code our engine runs.
# Usage: bench/build_llama_bench.sh [TOOL...]   (default: all four; prints the llama-bench path on its last line)
# Env:   EDGECHAT_BENCH_CACHE  cache root (default ~/.cache/edgechat-bench)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=packaging/llama_sources.sh
source "$repo_root/packaging/llama_sources.sh"
ver="$(llama_pin "$repo_root")"

prefix="${EDGECHAT_BENCH_CACHE:-$HOME/.cache/edgechat-bench}/llama.cpp-$ver"
bin="$prefix/bin"
tools=("$@")
if [[ ${#tools[@]} == 0 ]]; then
    tools=(llama-bench llama-server llama-quantize llama-imatrix)
fi
missing=0
for tool in "${tools[@]}"; do
    [[ -x "$bin/$tool" ]] || missing=1
done
if [[ $missing == 0 ]]; then
    echo "$bin/llama-bench"
    exit 0
fi

# The work tree lives in the cache, not /tmp, so an interrupted build resumes where it stopped.
work="$prefix/work"
llama_src="$(llama_sources "$work" "$ver")"

# Same configuration as llama-cpp-python's CPU source build: Release, shared libraries, curl off,
# GGML_NATIVE/OpenMP/llamafile at llama.cpp's defaults. GGML_NATIVE is pinned ON because its default
# flips to OFF when SOURCE_DATE_EPOCH is set, and the reference must use the host's SIMD like the
# engine. The web UI is neither built (npm) nor downloaded: the build must work offline.
# $ORIGIN rpath: the binaries find the libllama/libggml copies installed next to them.
cmake -S "$llama_src" -B "$work/build" "${cmake_generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON \
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

# Install into a temp dir and rename, so a half-copied bin/ never passes the check above; tools
# built earlier stay.
rm -rf "$prefix/bin.tmp"
mkdir -p "$prefix/bin.tmp"
if [[ -d "$bin" ]]; then
    cp -a "$bin/." "$prefix/bin.tmp/"
fi
for tool in "${tools[@]}"; do
    cp -a "$work/build/bin/$tool" "$prefix/bin.tmp/"
done
cp -a "$work/build/bin/"*.so* "$prefix/bin.tmp/"
rm -rf "$bin"
mv "$prefix/bin.tmp" "$bin"
# The build tree stays, so adding a tool later rebuilds only what changed.
rm -rf "$work/sdist"
echo "$bin/llama-bench"
