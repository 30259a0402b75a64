#!/usr/bin/env bash
# Build llama.cpp with its RPC backend from the sources vendored in the pinned llama-cpp-python
# sdist: libllama (+ libggml with RPC) for LLAMA_CPP_LIB_PATH, and ggml-rpc-server, the process
# that lends a machine's CPU or GPU to another one's llama.cpp. Used by tests/test_devices.py's
# loopback test; on real machines see packaging/GPU.md ("Several machines").
# Usage: packaging/build_llama_rpc.sh      (prints the directory holding both on its last line)
# Env:   EDGECHAT_BENCH_CACHE  cache root (default ~/.cache/edgechat-bench)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=packaging/llama_sources.sh
source "$repo_root/packaging/llama_sources.sh"
ver="$(llama_pin "$repo_root")"

prefix="${EDGECHAT_BENCH_CACHE:-$HOME/.cache/edgechat-bench}/llama.cpp-$ver-rpc"
bin="$prefix/bin"
if [[ -x "$bin/ggml-rpc-server" && -f "$bin/libllama.so" ]]; then
    echo "$bin"
    exit 0
fi

# The work tree lives in the cache, so an interrupted build resumes where it stopped.
work="$prefix/work"
llama_src="$(llama_sources "$work" "$ver")"

# llama-cpp-python's CPU configuration plus -DGGML_RPC=ON; tools on for ggml-rpc-server only.
# $ORIGIN rpath: libllama and ggml-rpc-server find the libggml built with them, not another one.
cmake -S "$llama_src" -B "$work/build" "${cmake_generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DGGML_RPC=ON \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
    -DCMAKE_INSTALL_RPATH="\$ORIGIN" >&2
cmake --build "$work/build" --target llama ggml-rpc-server -j"$(nproc)" >&2

# Install into a temp dir and rename, so a half-copied bin/ never passes the check above.
rm -rf "$prefix/bin.tmp"
mkdir -p "$prefix/bin.tmp"
cp -a "$work/build/bin/ggml-rpc-server" "$work/build/bin/"*.so* "$prefix/bin.tmp/"
rm -rf "$bin"
mv "$prefix/bin.tmp" "$bin"
rm -rf "$work"
echo "$bin"
