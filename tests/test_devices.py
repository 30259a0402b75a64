"""Devices: how many layers go to a GPU (--gpu-layers auto|N|all, per-model setting), what a
CPU-only build says about it, and, where a GPU build is installed, that offloading changes no answer."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from neartie import assert_same_or_near_tie

from edgechat.engine import Engine, EngineConfig
from edgechat.engine.runners import devices
from edgechat.engine.runners.devices import Device
from edgechat.engine.types.request import ChatRequest
from edgechat.errors import UsageError
from edgechat.models import planner, read_model_info
from edgechat.models.settings import with_model_settings
from edgechat.params import SamplingParams


def gpu(free: int) -> Device:
    return Device("CUDA0", "test GPU", "gpu", free, free)


def test_auto_offloads_what_free_gpu_memory_holds_with_the_kv_cache(smollm2_path):
    info = read_model_info(smollm2_path)
    plan = planner.plan_for(info, 4096, available=64 << 30)
    per_layer = info.size_bytes / (info.n_layer + 1) + plan.kv_cache / info.n_layer
    base = plan.compute + info.size_bytes / (info.n_layer + 1)  # compute buffers and the output layer

    def split(free, request="auto"):
        return planner.gpu_split(info, plan, request, [gpu(free)])

    everything = split(int((base + per_layer * info.n_layer) / planner.GPU_HEADROOM) + 1)
    assert everything.gpu_layers == info.n_layer and everything.n_gpu_layers == -1
    assert everything.describe() == f"CUDA0 (all {info.n_layer} layers)"
    half = split(int((base + per_layer * 12.5) / planner.GPU_HEADROOM))
    assert (half.gpu_layers, half.cpu_layers) == (12, info.n_layer - 12)
    # llama.cpp counts the output layer as one more and offloads it first
    assert half.n_gpu_layers == 13 and half.describe() == f"CUDA0 12/{info.n_layer} layers, CPU {info.n_layer - 12}"
    assert split(int(base * 0.5)).describe() == "CPU" and split(int(base * 0.5)).n_gpu_layers == 0
    # asked for: taken as given (capped at the model's layers); no GPU, no offload
    assert split(1, "all").gpu_layers == info.n_layer and split(1, 7).n_gpu_layers == 8 and split(1, 99).n_gpu_layers == -1
    assert planner.gpu_split(info, plan, "all", []).describe() == "CPU"
    with pytest.raises(UsageError, match="auto, all or a number"):
        planner.parse_gpu_layers("lots")


def edgechat(*args, env=None):
    return subprocess.run([sys.executable, "-m", "edgechat", *args], capture_output=True, text=True, timeout=300,
                          check=False, env=env)


@pytest.mark.skipif(bool(devices.gpu_devices()), reason="checks what a CPU-only llama.cpp says")
def test_a_cpu_only_build_says_in_one_line_that_gpu_layers_does_nothing(isolated_dirs):
    proc = edgechat("run", "--gpu-layers", "all", "--max-tokens", "4", "Name a colour.")
    assert proc.returncode == 0 and proc.stdout.strip()
    assert proc.stderr.strip().splitlines() == [
        "edgechat: note: this llama.cpp is a CPU-only build, so --gpu-layers has no effect (GPU builds: packaging/GPU.md)"
    ]
    bad = edgechat("run", "--gpu-layers", "lots", "Hi")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == ("edgechat: error: Invalid value for '--gpu-layers': use auto, all or a number of "
                                  "layers, not 'lots' (see: edgechat run --help)")
    # the models listing shows where layers go
    assert "LAYERS ON" in edgechat("models").stdout
    if "RPC" not in devices.backends():
        no_rpc = edgechat("run", "--rpc", "127.0.0.1:50052", "Hi")
        assert no_rpc.returncode != 0 and no_rpc.stderr.strip().splitlines() == [
            'edgechat: error: this llama.cpp has no RPC backend; reinstall llama-cpp-python with '
            'CMAKE_ARGS="-DGGML_RPC=ON" (packaging/GPU.md, several machines)']


def test_a_models_gpu_layers_setting_is_read_from_config(isolated_dirs, smollm2_path):
    isolated_dirs.config_file.parent.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text('[models."smollm2-135m-instruct"]\ngpu_layers = "several"\n')
    # read by the front ends (models/settings.py), which hand the engine the value; checked before anything loads
    with pytest.raises(UsageError, match=r"not 'several' \(--gpu-layers, or gpu_layers in config.toml\)"):
        with_model_settings(EngineConfig(model="smollm2-135m-instruct", n_ctx=512, paths=isolated_dirs))
    # an explicit value wins over the setting
    given = EngineConfig(model="smollm2-135m-instruct", n_ctx=512, n_gpu_layers=0, paths=isolated_dirs)
    with Engine(with_model_settings(given)) as engine:
        assert engine.gpu.describe() == "CPU"


@pytest.mark.skipif(not devices.gpu_devices(), reason="needs a GPU build of llama-cpp-python (packaging/GPU.md)")
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_auto_puts_every_layer_on_the_gpu_and_answers_as_the_cpu(model, isolated_dirs):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    request = dict(messages=messages, sampling=SamplingParams(temperature=0.0), max_tokens=32, speculative="off")
    with Engine(EngineConfig(model=model, n_ctx=1024, n_gpu_layers=0, paths=isolated_dirs)) as cpu:
        expected = cpu.submit(ChatRequest(**request)).result()
        with Engine(EngineConfig(model=model, n_ctx=1024, n_gpu_layers="auto", paths=isolated_dirs)) as gpu:
            assert gpu.gpu.cpu_layers == 0 and gpu.gpu.n_gpu_layers == -1, gpu.gpu
            got = gpu.submit(ChatRequest(**request)).result()
        print(f"{model}: CPU {expected.text!r}, {gpu.gpu.describe()} {got.text!r}")
        # CUDA's kernels round differently from the CPU's: the same text, or parted at a near-tie
        assert_same_or_near_tie(cpu, messages, expected.token_ids, got.token_ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(proc: subprocess.Popen, port: int) -> bool:
    """The server is up on its port, and it is the one listening there (it has not exited)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                time.sleep(0.2)  # a server that failed to bind exits at once: look again
                return proc.poll() is None
        time.sleep(0.1)
    return False


@contextlib.contextmanager
def rpc_servers(build: Path, n: int, tmp_path: Path):
    procs, endpoints = [], []
    try:
        for i in range(n):
            # each server listens before the next port is picked: picked earlier, the port of a
            # server not yet bound can come back (once in a full suite run here: the second server
            # failed to bind, both endpoints reached the first, and it took every layer); a port
            # taken by anything else makes the server exit, and the next free port is tried
            for _attempt in range(3):
                port = free_port()
                log = open(tmp_path / f"rpc-{i}.log", "w")  # noqa: SIM115 (closed with the process)
                proc = subprocess.Popen([str(build / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", str(planner.default_threads())],
                                        stdout=log, stderr=subprocess.STDOUT)
                procs.append((proc, log))
                if _listening(proc, port):
                    endpoints.append(f"127.0.0.1:{port}")
                    break
            else:
                pytest.fail(f"ggml-rpc-server {i} did not start; see {tmp_path}")
        yield endpoints
    finally:
        for proc, log in procs:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()


@pytest.mark.slow
def test_layers_on_two_rpc_servers_give_the_local_greedy_answer(llama_tools, isolated_dirs, tmp_path):
    args = ["run", "--temperature", "0", "--max-tokens", "16", "--speculative", "off", "--json", "Name three colours."]
    local = edgechat(*args)
    assert local.returncode == 0, local.stderr
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(llama_tools))
    with rpc_servers(llama_tools, 2, tmp_path) as endpoints:
        rpc = ",".join(endpoints)
        remote = edgechat(*args, "--rpc", rpc, "--gpu-layers", "all", env=env)
        assert remote.returncode == 0, remote.stderr
        doctor = edgechat("doctor", "--rpc", rpc, env=env)
    answer, remote_answer = json.loads(local.stdout), json.loads(remote.stdout)
    assert answer["device"] == "CPU" and remote_answer["device"] == "RPC0+RPC1 (all 30 layers)"
    assert remote_answer["text"] == answer["text"]
    # doctor lists the remote devices with their memory, and the split the planner would make
    assert doctor.returncode == 0, doctor.stderr
    assert f"backends: RPC, CPU, RPC[{endpoints[0]}], RPC[{endpoints[1]}];" in doctor.stdout
    for i, endpoint in enumerate(endpoints):
        assert f"device RPC{i} (gpu, {endpoint})" in doctor.stdout
    assert "RPC0+RPC1 (all 30 layers)" in doctor.stdout
    # a server that is gone is one line, not llama.cpp aborting the process
    gone = edgechat("run", "--rpc", endpoints[0], "Hi", env=env)
    lines = gone.stderr.strip().splitlines()
    assert gone.returncode == 2 and len(lines) == 1, gone.stderr
    assert lines[0].startswith(f"edgechat: error: no ggml-rpc-server answers at {endpoints[0]}")
