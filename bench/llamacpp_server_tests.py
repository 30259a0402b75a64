"""llama.cpp's own server tests (tools/server/tests in the vendored llama.cpp of the pinned
llama-cpp-python sdist) run against `edgechat serve` and against llama-server, on the same model.

    python -m bench.llamacpp_server_tests                      # both servers, the default subset, SmolLM2
    python -m bench.llamacpp_server_tests --server edgechat -k tokenize
    python -m bench.llamacpp_server_tests --model gemma3-270m --json out.json

The tests stay where the sdist unpacks them (bench/build_llama_bench.sh's cache); their utils.py
starts $LLAMA_SERVER_BIN_PATH with llama-server's flags, which bench/llamacpp_server_tests_shim.py
turns into `edgechat serve`'s options (or passes to llama-server) with every test's model replaced
by one local GGUF. Their tests were written for a 260k-parameter story model, so an expectation of
its exact words or token counts fails on both servers; what matters is the difference between the
two columns. Needs their test dependencies besides ours: `pip install wget` (utils.py imports it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.bench_serve import _free_port

REPO = Path(__file__).resolve().parents[1]
SHIM = Path(__file__).resolve().with_name("llamacpp_server_tests_shim.py")

# Their files that test what a client of either server meets: chat and legacy completions,
# tokenize, templates, props and models, tool calls, grammars and schemas, embeddings, the API key
# and CORS, Anthropic Messages and Responses. Left out: router/model loading, slot save and
# sleep, LoRA, rerank, infill, vision, speculative, MCP and built-in tools, GCP (not edgechat features).
DEFAULT_FILES = (
    "unit/test_basic.py", "unit/test_chat_completion.py", "unit/test_completion.py", "unit/test_tokenize.py",
    "unit/test_template.py", "unit/test_tool_call.py", "unit/test_embedding.py", "unit/test_security.py",
    "unit/test_ignore_eos.py", "unit/test_ctx_shift.py", "unit/test_compat_anthropic.py",
    "unit/test_compat_oai_responses.py",
)
SERVERS = ("edgechat", "llama-server")


def tests_dir() -> Path:
    """tools/server/tests of the vendored llama.cpp, unpacking the pinned sdist first where the
    cache lacks it (packaging/llama_sources.sh: from pip's cache or PyPI)."""
    script = (
        'source packaging/llama_sources.sh && ver="$(llama_pin .)" && '
        'llama_sources "${EDGECHAT_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgechat-bench}/llama.cpp-$ver/work" "$ver"'
    )
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit("cannot unpack the llama-cpp-python sdist (see packaging/llama_sources.sh)")
    folder = Path(proc.stdout.strip().splitlines()[-1]) / "tools" / "server" / "tests"
    if not (folder / "utils.py").is_file():
        raise SystemExit(f"{folder} holds no utils.py: is the sdist whole?")
    return folder


def read_junit(path: Path) -> dict[str, tuple[str, str]]:
    """{test id: (passed | failed | skipped, first line of the reason)} from pytest's JUnit XML."""
    results = {}
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test_id = f"{module}.py::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                outcome = name
                reason = (element.get("message") or element.text or "").strip().splitlines()[0:1]
                reason = reason[0][:160] if reason else ""
                break
        results[test_id] = (outcome, reason)
    return results


def run_suite(server: str, model: Path, folder: Path, files: list[str], select: str | None, work: Path,
              timeout: float) -> dict[str, tuple[str, str]]:
    """Their tests against one server, a pytest run per file (what ran survives an interrupted
    run); the servers' output goes to work/SERVER.log."""
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(SHIM),
        "EDGECHAT_LLAMACPP_TARGET": server,
        "EDGECHAT_LLAMACPP_MODEL": str(model),
        "EDGECHAT_LLAMACPP_PYTHON": sys.executable,
        "PORT": str(_free_port()),  # their default, 8080, may be taken on a shared machine
        "LLAMA_CACHE": str(work / "llama-cache"),
        "EDGECHAT_DATA_DIR": str(work / f"{server}-data"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.setdefault("EDGECHAT_THREADS", "1")
    if server == "llama-server":
        from bench.llamabench import find_llama_server
        from quantize.llm import use_extra_buffers

        env["EDGECHAT_LLAMACPP_SERVER"] = str(find_llama_server())
        env["EDGECHAT_LLAMACPP_NO_REPACK"] = "0" if use_extra_buffers() else "1"  # the engine's weight layout
    results = {}
    with open(work / f"{server}.log", "w") as log:
        for file in files:
            junit = work / f"{server}-{Path(file).stem}.xml"
            cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "bench.llamacpp_server_tests_plugin",
                   "-n", "0", "-q", "--timeout", str(timeout), "-m", "not slow", f"--junitxml={junit}",
                   *(["-k", select] if select else []), file]
            log.flush()
            subprocess.run(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
            if not junit.is_file():
                raise SystemExit(f"pytest wrote no results for {server} on {file}; see {work / f'{server}.log'}")
            results.update(read_junit(junit))
            print(f"  {server} {file}: {sum(1 for t in results if t.startswith(file + '::') and results[t][0] == 'passed')} passed", flush=True)
    return results


def report(results: dict[str, dict[str, tuple[str, str]]]) -> str:
    """One line per test (each server's outcome), then the counts."""
    servers = list(results)
    tests = sorted({t for r in results.values() for t in r})
    lines = []
    for test in tests:
        cells = [results[s].get(test, ("-", ""))[0] for s in servers]
        reasons = [f"{s}: {results[s][test][1]}" for s in servers if results[s].get(test, ("", ""))[0] == "failed"]
        lines.append(f"{'  '.join(f'{c:8}' for c in cells)}  {test}" + (f"\n{'':20}{' | '.join(reasons)}" if reasons else ""))
    lines.append("")
    for s in servers:
        counts = {o: sum(1 for v in results[s].values() if v[0] == o) for o in ("passed", "failed", "skipped")}
        lines.append(f"{s}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped of {len(results[s])}")
    if len(servers) == 2:
        a, b = servers
        only = {s: [t for t in tests if results[s].get(t, ("",))[0] == "passed" and results[o].get(t, ("",))[0] == "failed"]
                for s, o in ((a, b), (b, a))}
        for s in servers:
            lines.append(f"passed by {s} only: {len(only[s])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llamacpp_server_tests", description=__doc__.split("\n")[0])
    parser.add_argument("--server", choices=(*SERVERS, "both"), default="both")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="an embedded model's name or a GGUF path")
    parser.add_argument("-k", dest="select", help="pytest -k expression over their test names")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="their test files (relative to tools/server/tests)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a test may take (a hang guard)")
    parser.add_argument("--json", type=Path, help="write {server: {test: [outcome, reason]}} here")
    parser.add_argument("--keep", type=Path, help="keep the servers' logs and JUnit files in this folder")
    args = parser.parse_args(argv)

    from edgechat.config import get_paths
    from edgechat.models import resolve_model

    model = resolve_model(args.model, get_paths())
    folder = tests_dir()
    servers = SERVERS if args.server == "both" else (args.server,)
    with tempfile.TemporaryDirectory(prefix="llamacpp-tests-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = {}
        for server in servers:
            print(f"running {len(args.files)} of their files against {server} on {model.name} ...", flush=True)
            results[server] = run_suite(server, model, folder, args.files, args.select, work, args.timeout)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
