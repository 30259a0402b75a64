"""Replayed traffic on a real model: `edgechat serve` beside llama.cpp's `llama-server`, same model,
same settings (2 threads, 4 sequences of 20,480 tokens), same run.

The mixes (edgechat/loadgen.py: chat, agents, document) are replayed at their times against each
server, fresh processes, alternating which goes first; TTFT and TPOT p50/p95/p99 and goodput.
Target: p99 TTFT and TPOT <= 1.0x llama-server's on every mix.

A long document among live chats: the document mix's chats alone, its 16,000-token document alone,
and both, on edgechat at each prefill chunk size (`--prefill-chunk`) and on llama-server (its
default batch of 2,048). Targets: the chats' TPOT p99 within 2x of theirs alone, the document's
TTFT within 1.1x of it alone. Each of the three runs draws its words from its own seed, so no run
finds another's prompt in a cache.

    python -m bench.bench_traffic [--model 0.5b|1.5b|PATH] [--mixes chat,agents,document]
                                  [--chunks 128,512] [--skip-mixes] [--skip-document] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.bench_serve import _free_port, _server
from edgechat.loadgen import MIXES, TraceReport, mix, replay

THREADS, PARALLEL, CTX = 2, 4, 20_480


def _model(name: str) -> Path:
    from bench.realmodel import real_model_1_5b_path, real_model_path

    if name in ("0.5b", "1.5b"):
        return real_model_path() if name == "0.5b" else real_model_1_5b_path()
    return Path(name)


def _llama_cmd(model: Path, port: int) -> list[str]:
    from bench.llamabench import find_llama_server
    from quantize.llm import use_extra_buffers

    return [str(find_llama_server()), "-m", str(model), "-t", str(THREADS), "-tb", str(THREADS), "-c", str(CTX * PARALLEL),
            "-np", str(PARALLEL), "--no-webui", "--host", "127.0.0.1", "--port", str(port),
            *([] if use_extra_buffers() else ["--no-repack"])]


def _edge_cmd(model: Path, port: int, chunk: int | None = None) -> list[str]:
    # a data folder of its own: no server finds an earlier one's prompts in the disk cache
    return [sys.executable, "-m", "edgechat", "serve", "-m", str(model), "--threads", str(THREADS), "--ctx", str(CTX),
            "--parallel", str(PARALLEL), "--port", str(port), "--degrade-queue-wait", "0", "--speculative", "off",
            "--data-dir", tempfile.mkdtemp(prefix="bench-traffic-"), *(["--prefill-chunk", str(chunk)] if chunk else [])]


def _replay(url: str, entries, seed: int, label: str) -> TraceReport:
    def progress(done: int, total: int) -> None:
        print(f"\r{label}: {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    return asyncio.run(replay(url, entries, seed=seed, timeout=1800.0, slo_ttft=5.0, slo_tpot=0.25, progress=progress))


def _servers(model: Path, log_dir: Path, chunk: int | None = None):
    """Both servers' commands by name, each with its own free port."""
    ports = {"llama-server": _free_port(), "edgechat": _free_port()}
    return {"llama-server": (_llama_cmd(model, ports["llama-server"]), ports["llama-server"]),
            "edgechat": (_edge_cmd(model, ports["edgechat"], chunk), ports["edgechat"])}


def run_mixes(model: Path, names: list[str], log_dir: Path) -> dict:
    out: dict = {}
    for i, name in enumerate(names):
        entries = mix(name)
        order = ["llama-server", "edgechat"] if i % 2 == 0 else ["edgechat", "llama-server"]
        for server in order:
            cmd, port = _servers(model, log_dir)[server]
            with _server(cmd, port, server, log_dir) as url:
                out.setdefault(name, {})[server] = _replay(url, entries, 0, f"{name} on {server}")
    return out


def _document_runs(url: str, label: str) -> dict[str, TraceReport]:
    entries = mix("document")
    chats = [e for e in entries if e.group != "document"]
    (document,) = [replace(e, at=0.0) for e in entries if e.group == "document"]
    return {"chats": _replay(url, chats, 1, f"{label} chats alone"), "document": _replay(url, [document], 2, f"{label} document alone"),
            "both": _replay(url, entries, 3, f"{label} both")}


def run_document(model: Path, chunks: list[int], log_dir: Path) -> dict:
    out: dict = {}
    configs = [("llama-server", None), *(("edgechat", c) for c in chunks)]
    for server, chunk in configs:
        label = server if chunk is None else f"edgechat chunk {chunk}"
        cmd, port = _servers(model, log_dir, chunk)[server]
        with _server(cmd, port, server, log_dir) as url:
            runs = _document_runs(url, label)
        chats_alone, doc_alone, both = runs["chats"], runs["document"], runs["both"]
        out[label] = {
            "chats_tpot_p99_alone": chats_alone.tpot["p99"], "chats_tpot_p99_with_document": both.kinds["chat"]["tpot"]["p99"],
            "document_ttft_alone": doc_alone.ttft["p50"], "document_ttft_with_chats": both.kinds["document"]["ttft"]["p50"],
            "errors": {**chats_alone.errors, **doc_alone.errors, **both.errors},
        }
        row = out[label]
        row["tpot_ratio"] = row["chats_tpot_p99_with_document"] / row["chats_tpot_p99_alone"] if row["chats_tpot_p99_alone"] else 0.0
        row["ttft_ratio"] = row["document_ttft_with_chats"] / row["document_ttft_alone"] if row["document_ttft_alone"] else 0.0
    return out


def _print_mixes(results: dict) -> None:
    for name, by_server in results.items():
        for server, report in by_server.items():
            print(f"--- {name} on {server}\n{report.table()}\n")
        ref, ours = by_server["llama-server"], by_server["edgechat"]
        for what in ("ttft", "tpot"):
            r, o = getattr(ref, what)["p99"], getattr(ours, what)["p99"]
            ratio = o / r if r else 0.0
            print(f"{name}: {what.upper()} p99 edgechat/llama-server = {ratio:.2f}x (target <= 1.0x: {'met' if ratio <= 1.0 else 'MISSED'})")
        print()


def _print_document(results: dict) -> None:
    print(f"{'':22}{'chats TPOT p99 alone/with':>28}{'ratio':>8}{'document TTFT alone/with':>28}{'ratio':>8}  errors")
    for label, row in results.items():
        print(f"{label:22}{row['chats_tpot_p99_alone'] * 1000:>13.0f} /{row['chats_tpot_p99_with_document'] * 1000:>8.0f} ms"
              f"{row['tpot_ratio']:>8.2f}{row['document_ttft_alone']:>15.1f} /{row['document_ttft_with_chats']:>8.1f} s "
              f"{row['ttft_ratio']:>7.2f}  {row['errors'] or '-'}")
    print("targets: chats' TPOT p99 <= 2x, document's TTFT <= 1.1x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="0.5b", help="0.5b, 1.5b (the real Qwen2.5-Coder models) or a GGUF path")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--chunks", default="128,512", help="edgechat's prefill chunk sizes to try on the document")
    ap.add_argument("--skip-mixes", action="store_true")
    ap.add_argument("--skip-document", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    args = ap.parse_args(argv)
    model = _model(args.model)
    mixes = {} if args.skip_mixes else run_mixes(model, [m for m in args.mixes.split(",") if m], args.log_dir)
    document = {} if args.skip_document else run_document(model, [int(c) for c in args.chunks.split(",") if c], args.log_dir)
    if args.json:
        print(json.dumps({"mixes": {n: {s: json.loads(r.to_json()) for s, r in by.items()} for n, by in mixes.items()},
                          "document": document}, indent=2))
    else:
        with contextlib.suppress(BrokenPipeError):
            _print_mixes(mixes)
            if document:
                _print_document(document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
