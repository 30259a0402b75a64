#!/usr/bin/env bash
# Build llama.cpp with its RPC backend from the sources vendored in the pinned llama-cpp-python
# sdist: libllama (+ libggml with RPC) for LLAMA_CPP_LIB_PATH, and ggml-rpc-server, the process
# that lends a machine's CPU or GPU to another one's llama.cpp (packaging/GPU.md, "Several
# machines"). It is the build the benchmarks and the test suite use, so one build serves all.
# Usage: packaging/build_llama_rpc.sh      (prints the directory holding both on its last line)
# Env:   EDGECHAT_BENCH_CACHE  cache root (default ${XDG_CACHE_HOME:-~/.cache}/edgechat-bench)
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bench="$("$repo_root/bench/build_llama_bench.sh" ggml-rpc-server | tail -n 1)"
dirname "$bench"
