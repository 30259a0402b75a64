#!/usr/bin/env python3
"""Stands in for `llama-server` under llama.cpp's own server tests, whose utils.py starts
$LLAMA_SERVER_BIN_PATH with llama-server's flags. bench/llamacpp_server_tests.py points that
variable here and says, through the environment, which server to become:

    EDGECHAT_LLAMACPP_TARGET   edgechat | llama-server
    EDGECHAT_LLAMACPP_MODEL    the GGUF every test's model (a Hub repo, a file) is replaced by
    EDGECHAT_LLAMACPP_SERVER   llama-server's path (target llama-server)
    EDGECHAT_LLAMACPP_NO_REPACK 1 where the engine keeps weights in plain buffers (AMX CPUs)
    EDGECHAT_LLAMACPP_PYTHON   the Python that runs `edgechat serve` (the runner's own)
    EDGECHAT_THREADS           threads, on both sides

Both sides get the same replacement model and thread count, so the two runs differ only in the
server. The process execs the server (same pid), so the tests' terminate() reaches it. A flag
edgechat has no equivalent of ends the start with a one-line reason (the test then fails on
"Server process died", and the report says which flag).
"""

from __future__ import annotations

import os
import sys

# llama-server's flags that choose the model: replaced by EDGECHAT_LLAMACPP_MODEL on both sides
MODEL_FLAGS = {"--model", "-m", "--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model-url", "-mu"}

# llama-server flag -> edgechat serve option taking the same value
SAME_VALUE = {
    "--port": "--port",
    "--host": "--host",
    "--api-key": "--api-key",
    "--cors-origins": "--cors-origins",
    "--cache-ram": "--cache-ram",
    "--chat-template-file": "--chat-template",
    "-ctk": "--kv-type",
    "--cache-type-k": "--kv-type",
    "-fa": "--flash-attn",
    "--flash-attn": "--flash-attn",
    "--n-gpu-layers": "--gpu-layers",
    "-ngl": "--gpu-layers",
}
# flags with a value that edgechat decides by itself: sampling defaults come from the GGUF,
# batch sizes from the engine, an answer's length from the request
IGNORED_WITH_VALUE = {"--temp", "--seed", "--batch-size", "-b", "--ubatch-size", "-ub", "--n-predict", "-n", "-ctv",
                      "--cache-type-v", "--tags", "--pooling", "--threads", "-t"}
# switches that are always on in edgechat serve (continuous batching, embeddings, /metrics, Jinja
# templates, context shift, one KV pool) or that only concern llama-server (its web UI, /slots,
# its download cache, its log)
IGNORED_SWITCHES = {"--offline", "--cont-batching", "--embedding", "--embeddings", "--metrics", "--kv-unified",
                    "--no-slots", "--slots", "--no-ui", "--no-webui", "--jinja", "--no-jinja", "--verbose",
                    "--context-shift"}
# llama-server's --reasoning-format values -> edgechat's
REASONING_FORMATS = {"deepseek": "auto", "auto": "auto", "none": "none"}


def _pairs(argv: list[str]):
    """(flag, value or None) in order; a value is the next word unless it is itself a flag
    (negative numbers are values)."""
    i = 0
    while i < len(argv):
        flag = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if nxt is not None and (not nxt.startswith("-") or nxt.lstrip("-").replace(".", "").isdigit()):
            yield flag, nxt
            i += 2
        else:
            yield flag, None
            i += 1


def edgechat_args(argv: list[str], model: str) -> list[str]:
    """`edgechat serve`'s arguments for llama-server's argv; SystemExit with the reason for a
    flag that has no equivalent."""
    # llama-server answers a request naming any model with its one model, as --any-model-name does
    out = ["-m", model, "--any-model-name"]
    pairs = list(_pairs(argv))
    values = dict(pairs)
    ctx, parallel = values.get("--ctx-size") or values.get("-c"), values.get("--parallel") or values.get("-np")
    # llama-server's -c is the whole KV cache, which its -np slots share out; edgechat's --ctx is
    # each sequence's, so a test's per-slot limits hold on both
    if parallel is not None:
        out += ["--parallel", parallel]
    if ctx is not None:
        out += ["--ctx", str(int(ctx) // int(parallel or 1))]
    for flag, value in pairs:
        if flag in ("--ctx-size", "-c", "--parallel", "-np"):
            continue
        if flag in MODEL_FLAGS or flag in IGNORED_WITH_VALUE or (flag in IGNORED_SWITCHES and value is None):
            continue
        if flag in SAME_VALUE and value is not None:
            out += [SAME_VALUE[flag], value]
        elif flag == "--alias" and value is not None:
            for alias in value.split(","):
                out += ["--alias", alias]
        elif flag == "--swa-full" and value is None:
            out += ["--swa-cache", "full"]
        elif flag == "--reasoning-format" and value in REASONING_FORMATS:
            out += ["--reasoning-format", REASONING_FORMATS[value]]
        elif flag == "--reasoning" and value in ("on", "off", "auto"):
            out += ["--reasoning-budget", "0" if value == "off" else "-1"]
        else:
            raise SystemExit(f"edgechat serve has no equivalent of llama-server's {flag}{'' if value is None else ' ' + value}")
    threads = os.environ.get("EDGECHAT_THREADS")
    return out + (["--threads", threads] if threads else [])


def llama_server_args(argv: list[str], model: str) -> list[str]:
    """llama-server's own argv with the model and thread count replaced as for edgechat."""
    out = ["-m", model]
    for flag, value in _pairs(argv):
        if flag in MODEL_FLAGS or flag in ("--threads", "-t"):
            continue
        out += [flag] if value is None else [flag, value]
    if threads := os.environ.get("EDGECHAT_THREADS"):
        out += ["--threads", threads]
    if os.environ.get("EDGECHAT_LLAMACPP_NO_REPACK") == "1":
        out.append("--no-repack")
    return out


def main() -> None:
    target, model = os.environ["EDGECHAT_LLAMACPP_TARGET"], os.environ["EDGECHAT_LLAMACPP_MODEL"]
    argv = sys.argv[1:]
    if target == "llama-server":
        server = os.environ["EDGECHAT_LLAMACPP_SERVER"]
        os.execv(server, [server, *llama_server_args(argv, model)])
    try:
        args = edgechat_args(argv, model)
    except SystemExit as refusal:
        print(f"llamacpp_server_tests_shim: {refusal}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    python = os.environ.get("EDGECHAT_LLAMACPP_PYTHON", sys.executable)
    os.execv(python, [python, "-m", "edgechat", "serve", *args])


if __name__ == "__main__":
    main()
