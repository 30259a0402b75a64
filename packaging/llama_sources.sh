# shellcheck shell=bash
# Sourced where llama.cpp's sources vendored in the pinned llama-cpp-python sdist are needed, so
# that every build is of exactly the code the engine runs: bench/build_llama_bench.sh (the one
# cmake configuration; packaging/build_llama_rpc.sh runs it for ggml-rpc-server) and
# bench/llamacpp_server_tests.py (llama.cpp's server tests).
#   llama_pin REPO_ROOT     prints the pinned llama-cpp-python version (exits if there is none)
#   llama_sources WORK VER  unpacks that sdist under WORK once; prints the vendored llama.cpp dir
#   cmake_generator         an array: -G Ninja where ninja exists

llama_pin() {
    local ver
    ver="$(sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' "$1/pyproject.toml")"
    if [[ -z "$ver" ]]; then
        echo "error: no llama-cpp-python==VERSION pin found in $1/pyproject.toml" >&2
        exit 1
    fi
    echo "$ver"
}

llama_sources() {
    local work="$1" ver="$2"
    local src="$work/llama_cpp_python-$ver"
    mkdir -p "$work" || return 1
    if [[ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]]; then
        # a command substitution runs without set -e: each failure returns at once
        pip download --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$work/sdist" >&2 || return 1
        tar -xzf "$work/sdist/llama_cpp_python-$ver.tar.gz" -C "$work" || return 1
    fi
    echo "$src/vendor/llama.cpp"
}

# read by the scripts that source this file
# shellcheck disable=SC2034
cmake_generator=()
if command -v ninja >/dev/null; then
    # shellcheck disable=SC2034
    cmake_generator=(-G Ninja)
fi
