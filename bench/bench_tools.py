"""Function calling and JSON answers on the small model people run: `edgechat serve` against
`llama-server --jinja` on the same GGUF in the same run, through the official `openai` client.

The model is Qwen2.5-Coder-0.5B-Instruct Q4_K_M (bench/realmodel.py), greedy (temperature 0),
`tool_choice: "auto"`, one sequence on each server. The cases (42): a call to the one tool
offered; the right one of six; two calls in one turn; a question that wants no call; an answer
from a tool's result; `json_schema` answers at max_tokens 24, 48, 96 and 256. For each case it
prints what was expected and what each server returned, and whether the model's text showed the
right intent: llama-server's answer read whole, its `content` included (where it did not
recognize a call, the model's raw call JSON is there), so a case counts as intended when the
right calls appear in it as calls or as JSON objects anywhere in the text.

First, decode speed: a long answer with the six tools declared (`auto`, no call wanted) against
the same request without tools, tokens/s from each response's `timings`, rounds alternating.

    python -m bench.bench_tools [--threads 2] [--speed-rounds 3] [--json out.json] [--only simple]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import openai

from bench.bench_serve import _free_port, _server

CTX = 4096


def _fn(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    params = {"type": "object", "properties": properties, "required": required if required is not None else list(properties)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


_S = {"type": "string"}
TOOLS = {
    "get_weather": _fn("get_weather", "Get the current weather in a city.", {"city": {**_S, "description": "The city name"}}),
    "convert_currency": _fn("convert_currency", "Convert an amount of money from one currency to another.", {
        "amount": {"type": "number"}, "from_currency": {**_S, "description": "ISO code, e.g. USD"},
        "to_currency": {**_S, "description": "ISO code, e.g. EUR"}}),
    "send_email": _fn("send_email", "Send an email.", {
        "to": {**_S, "description": "The recipient's address"}, "subject": _S, "body": _S}),
    "search_web": _fn("search_web", "Search the web and return the top results.", {"query": _S}),
    "get_time": _fn("get_time", "Get the current local time in a time zone.", {
        "timezone": {**_S, "description": "IANA time zone, e.g. Europe/Paris"}}),
    "calculate": _fn("calculate", "Evaluate an arithmetic expression.", {
        "expression": {**_S, "description": "e.g. 2 * (3 + 4)"}}),
}
SIX = list(TOOLS)


@dataclass
class Case:
    id: str
    kind: str  # simple | pick | parallel | none | result | json
    messages: list[dict]
    tools: list[str] = field(default_factory=list)
    calls: list[tuple[str, dict]] = field(default_factory=list)  # expected, in any order
    answer: str = ""  # result: a word the answer must hold
    schema: dict | None = None  # json: the answer must parse and validate
    max_tokens: int = 256

    @property
    def expected(self) -> str:
        if self.kind == "json":
            return f"valid JSON (max_tokens {self.max_tokens})"
        if self.kind == "result":
            return f'no call, answer says "{self.answer}"'
        if not self.calls:
            return "no call"
        return "; ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in self.calls)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _result(question: str, name: str, args: dict, result: dict) -> list[dict]:
    """A turn where the model called `name` and the tool answered: the model answers from it."""
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return [{"role": "user", "content": question}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(result)}]


PERSON = {"type": "object", "properties": {"name": _S, "age": {"type": "integer"}, "city": _S},
          "required": ["name", "age", "city"], "additionalProperties": False}
RECIPE = {"type": "object", "properties": {"title": _S, "ingredients": {"type": "array", "items": _S, "minItems": 1},
                                           "minutes": {"type": "integer"}},
          "required": ["title", "ingredients", "minutes"], "additionalProperties": False}
MEETING = {"type": "object", "properties": {
    "topic": _S, "priority": {"enum": ["low", "medium", "high"]},
    "attendees": {"type": "array", "items": {"type": "object", "properties": {"name": _S, "email": _S},
                                             "required": ["name", "email"], "additionalProperties": False}}},
    "required": ["topic", "priority", "attendees"], "additionalProperties": False}
JSON_PROMPTS = (
    ("person", PERSON, "Extract the person as JSON: Maria Lopez is a 34-year-old architect who lives in Seville "
                       "and has designed three museums along the river."),
    ("recipe", RECIPE, "Give me a simple pancake recipe as JSON, with every ingredient and how many minutes it takes."),
    ("meeting", MEETING, "Write the meeting as JSON: a high-priority review of the quarterly budget with Alice Brown "
                         "(alice@example.com), Bob Chen (bob@example.com) and Carol Diaz (carol@example.com)."),
)


def cases() -> list[Case]:
    w, c = "get_weather", "convert_currency"
    out = [
        Case("simple-weather", "simple", _user("What's the weather like in Paris right now?"), [w], [(w, {"city": "Paris"})]),
        Case("simple-weather-2", "simple", _user("Is it raining in Tokyo?"), [w], [(w, {"city": "Tokyo"})]),
        Case("simple-currency", "simple", _user("Convert 100 USD to EUR."), [c], [(c, {"amount": 100, "from_currency": "USD", "to_currency": "EUR"})]),
        Case("simple-search", "simple", _user("Search the web for the latest Python release notes."), ["search_web"],
             [("search_web", {"query": None})]),
        Case("simple-time", "simple", _user("What time is it in Europe/Berlin?"), ["get_time"], [("get_time", {"timezone": "Europe/Berlin"})]),
        Case("simple-calc", "simple", _user("Use the calculator to compute 37 * 49."), ["calculate"], [("calculate", {"expression": None})]),
        Case("simple-email", "simple", _user("Send an email to bob@example.com with subject 'Lunch' saying 'See you at noon'."),
             ["send_email"], [("send_email", {"to": "bob@example.com", "subject": "Lunch", "body": None})]),
        Case("simple-weather-3", "simple", _user("Tell me the current weather in New York."), [w], [(w, {"city": "New York"})]),
        Case("pick-weather", "pick", _user("How warm is it in Madrid today?"), SIX, [(w, {"city": "Madrid"})]),
        Case("pick-currency", "pick", _user("How much is 50 GBP in JPY?"), SIX, [(c, {"amount": 50, "from_currency": "GBP", "to_currency": "JPY"})]),
        Case("pick-email", "pick", _user("Email alice@example.com with the subject 'Report' and the body 'The report is ready.'"),
             SIX, [("send_email", {"to": "alice@example.com", "subject": "Report", "body": None})]),
        Case("pick-search", "pick", _user("Find news articles about the Mars rover on the web."), SIX, [("search_web", {"query": None})]),
        Case("pick-time", "pick", _user("What is the local time in Asia/Tokyo?"), SIX, [("get_time", {"timezone": "Asia/Tokyo"})]),
        Case("pick-calc", "pick", _user("Calculate 1234 + 5678 with the calculator tool."), SIX, [("calculate", {"expression": None})]),
        Case("pick-weather-2", "pick", _user("I'm flying to Rome tomorrow; what's the weather there now?"), SIX, [(w, {"city": "Rome"})]),
        Case("pick-currency-2", "pick", _user("Convert 20 EUR into USD for me."), SIX, [(c, {"amount": 20, "from_currency": "EUR", "to_currency": "USD"})]),
        Case("parallel-weather", "parallel", _user("What's the weather in Paris and in London?"), [w],
             [(w, {"city": "Paris"}), (w, {"city": "London"})]),
        Case("parallel-weather-6", "parallel", _user("Get the weather for both Berlin and Vienna."), SIX,
             [(w, {"city": "Berlin"}), (w, {"city": "Vienna"})]),
        Case("parallel-time", "parallel", _user("What time is it in America/New_York and in Asia/Tokyo?"), SIX,
             [("get_time", {"timezone": "America/New_York"}), ("get_time", {"timezone": "Asia/Tokyo"})]),
        Case("parallel-mixed", "parallel", _user("Tell me the weather in Oslo and the local time in Europe/Oslo."), SIX,
             [(w, {"city": "Oslo"}), ("get_time", {"timezone": "Europe/Oslo"})]),
        Case("parallel-currency", "parallel", _user("Convert 10 USD to EUR and 10 USD to GBP."), SIX,
             [(c, {"amount": 10, "from_currency": "USD", "to_currency": "EUR"}), (c, {"amount": 10, "from_currency": "USD", "to_currency": "GBP"})]),
        Case("none-greeting", "none", _user("Hi! How are you today?"), SIX),
        Case("none-code", "none", _user("Write a Python function that reverses a string."), SIX),
        Case("none-fact", "none", _user("What is the capital of France?"), SIX),
        Case("none-explain", "none", _user("Explain in one sentence what a linked list is."), SIX),
        Case("none-weather-tool-only", "none", _user("Write a haiku about autumn leaves."), [w]),
        Case("result-weather", "result", _result("What's the weather in Paris?", w, {"city": "Paris"},
                                                  {"city": "Paris", "temperature_c": 18, "sky": "cloudy"}), [w], answer="18"),
        Case("result-currency", "result", _result("Convert 100 USD to EUR.", c, {"amount": 100, "from_currency": "USD", "to_currency": "EUR"},
                                                   {"amount": 92.5, "currency": "EUR"}), SIX, answer="92.5"),
        Case("result-time", "result", _result("What time is it in Asia/Tokyo?", "get_time", {"timezone": "Asia/Tokyo"},
                                               {"time": "21:45"}), SIX, answer="21:45"),
        Case("result-calc", "result", _result("What is 37 * 49?", "calculate", {"expression": "37 * 49"}, {"result": 1813}),
             SIX, answer="1813"),
    ]
    for name, schema, prompt in JSON_PROMPTS:
        for n in (24, 48, 96, 256):
            out.append(Case(f"json-{name}-{n}", "json", _user(prompt), schema=schema, max_tokens=n))
    return out


# -- judging ------------------------------------------------------------------------------------

def _same(expected: object, got: object) -> bool:
    """An argument as expected: None takes any non-empty value; strings compare without case
    or surrounding space; numbers by value."""
    if expected is None:
        return got not in (None, "", [], {})
    if isinstance(expected, str):
        return isinstance(got, str) and got.strip().lower() == expected.lower()
    if isinstance(expected, (int, float)):
        try:
            return float(got) == float(expected)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False
    return got == expected


def calls_match(expected: list[tuple[str, dict]], got: list[tuple[str, dict]]) -> bool:
    left = list(got)
    if len(left) != len(expected):
        return False
    for name, args in expected:
        hit = next((g for g in left if g[0] == name and all(_same(v, g[1].get(k)) for k, v in args.items())), None)
        if hit is None:
            return False
        left.remove(hit)
    return True


def json_calls_in(text: str) -> list[tuple[str, dict]]:
    """Every call-shaped JSON value in `text` ({"name", "arguments"|"parameters"}, alone or in a
    list), wherever it stands: what the model meant to call, recognized or not."""
    from edgechat.engine.output.toolfamilies import call_objects

    decoder, found, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                i += 1
                continue
            calls = call_objects(value)
            if calls:
                found += calls
                i = end
                continue
        i += 1
    return found


@dataclass
class Outcome:
    calls: list[tuple[str, dict]]
    content: str
    finish: str
    completion_tokens: int
    error: str = ""

    def show(self) -> str:
        if self.error:
            return f"error: {self.error}"
        if self.calls:
            return "; ".join(f"{n}({json.dumps(a, ensure_ascii=False)})" for n, a in self.calls)
        text = " ".join(self.content.split())
        return f"text: {text[:70]}{'...' if len(text) > 70 else ''}"


def passed(case: Case, out: Outcome) -> bool:
    if out.error:
        return False
    if case.kind == "json":
        try:
            jsonschema.validate(json.loads(out.content), case.schema or {})
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    # an answer holding a call to an offered tool as text is no answer: the client got neither
    # the call nor prose (a call to a tool nobody offered is text the model chose to write)
    as_text = [name for name, _ in json_calls_in(out.content) if name in case.tools]
    if case.kind == "result":
        return not out.calls and not as_text and case.answer.lower() in out.content.lower()
    if not case.calls:
        return not out.calls and not as_text and bool(out.content.strip())
    return calls_match(case.calls, out.calls)


def intended(case: Case, out: Outcome) -> bool | None:
    """Whether the model's whole answer (calls as recognized plus any call JSON left in the text)
    shows the expected intent; None for JSON answers (validity is their measure)."""
    if case.kind == "json" or out.error:
        return None
    meant = out.calls + json_calls_in(out.content)
    if case.kind == "result":
        return not meant and case.answer.lower() in out.content.lower()
    if not case.calls:
        return not meant
    return calls_match(case.calls, meant)


# -- running ------------------------------------------------------------------------------------

def ask(client: openai.OpenAI, model: str, case: Case) -> Outcome:
    body: dict = {"model": model, "messages": case.messages, "temperature": 0, "max_tokens": case.max_tokens}
    if case.tools:
        body |= {"tools": [TOOLS[t] for t in case.tools], "tool_choice": "auto"}
    if case.schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": case.schema, "strict": True}}
    try:
        resp = client.chat.completions.create(**body)
    except openai.APIError as e:
        return Outcome([], "", "", 0, error=str(e).splitlines()[0][:120])
    choice = resp.choices[0]
    calls = []
    for tc in choice.message.tool_calls or []:
        try:
            args = json.loads(tc.function.arguments or "{}")
        except json.JSONDecodeError:
            args = {"<unparsed>": tc.function.arguments}
        calls.append((tc.function.name, args if isinstance(args, dict) else {"<not an object>": args}))
    tokens = resp.usage.completion_tokens if resp.usage else 0
    return Outcome(calls, choice.message.content or "", choice.finish_reason or "", tokens)


# a coding task: with the tools declared too this model answers it at length, where a story request
# gets a short refusal or a call
SPEED_PROMPT = "Write a Python class for a linked list with insert, delete, search and reverse methods, each with a docstring."
SPEED_TOKENS = 128


def decode_tps(client: openai.OpenAI, model: str, tools: bool) -> tuple[float, int]:
    """Decode tokens/s of one long answer (the server's own `timings`), and its token count."""
    body: dict = {"model": model, "messages": _user(SPEED_PROMPT), "temperature": 0, "max_tokens": SPEED_TOKENS}
    if tools:
        body |= {"tools": [TOOLS[t] for t in SIX], "tool_choice": "auto"}
    resp = client.chat.completions.create(**body)
    timings = (resp.model_extra or {}).get("timings") or {}
    return float(timings.get("predicted_per_second", 0.0)), resp.usage.completion_tokens if resp.usage else 0


def _commands(model_path: Path, threads: int, ports: dict[str, int]) -> dict[str, list[str]]:
    """Each server's command line, one sequence and the same context on both."""
    commands = {}
    if "edgechat" in ports:
        commands["edgechat"] = [
            sys.executable, "-m", "edgechat", "serve", "-m", str(model_path), "--threads", str(threads),
            "--ctx", str(CTX), "--parallel", "1", "--port", str(ports["edgechat"]),
            "--speculative", "off",  # llama-server guesses nothing by default: compare the same decoding
        ]
    if "llama-server" in ports:
        from bench.llamabench import find_llama_server
        from quantize.llm import use_extra_buffers

        commands["llama-server"] = [
            str(find_llama_server()), "-m", str(model_path), "--jinja", "-t", str(threads), "-tb", str(threads),
            "-c", str(CTX), "-np", "1", "--no-webui", "--host", "127.0.0.1", "--port", str(ports["llama-server"]),
            *([] if use_extra_buffers() else ["--no-repack"]),  # the engine's weight layout (see bench_serve)
        ]
    return commands


def report(rows: list[tuple[Case, dict[str, Outcome]]], speed: dict) -> tuple[str, dict]:
    """The table of cases (markdown) and the scores."""
    servers = list(rows[0][1]) if rows else []
    reader = "llama-server" if "llama-server" in servers else servers[0] if servers else ""
    lines = [f"| case | expected | {' | '.join(servers)} | intent shown |", "|---|---|" + "---|" * len(servers) + "---|"]
    for case, outs in rows:
        marks = [("ok: " if passed(case, outs[s]) else "FAIL: ") + outs[s].show().replace("|", "\\|") for s in servers]
        intent = intended(case, outs[reader])
        lines.append(f"| {case.id} | {case.expected} | {' | '.join(marks)} | {'-' if intent is None else 'yes' if intent else 'no'} |")
    lines.append("")
    calls = [(c, o) for c, o in rows if c.kind != "json"]
    meant = [(c, o) for c, o in calls if intended(c, o[reader])]
    scores: dict = {"cases": len(calls), "intended": len(meant), "score": {}, "score_intended": {}, "json_valid": {}, "speed_ratio": {}}
    for s in servers:
        scores["score"][s] = sum(passed(c, o[s]) for c, o in calls)
        scores["score_intended"][s] = sum(passed(c, o[s]) for c, o in meant)
    lines.append(f"function-calling cases: {len(calls)}; " + ", ".join(f"{s} {scores['score'][s]}" for s in servers))
    lines.append(f"cases whose text ({reader}'s) shows the right intent: {len(meant)}; passed of them: "
                 + ", ".join(f"{s} {scores['score_intended'][s]}" for s in servers))
    for kind in ("simple", "pick", "parallel", "none", "result"):
        kc = [(c, o) for c, o in calls if c.kind == kind]
        lines.append(f"  {kind}: {len(kc)} cases, " + ", ".join(f"{s} {sum(passed(c, o[s]) for c, o in kc)}" for s in servers))
    for n in sorted({c.max_tokens for c, _ in rows if c.kind == "json"}):
        jc = [(c, o) for c, o in rows if c.kind == "json" and c.max_tokens == n]
        valid = {s: sum(passed(c, o[s]) for c, o in jc) for s in servers}
        scores["json_valid"][n] = valid
        lines.append(f"json_schema at max_tokens {n}: valid " + ", ".join(f"{s} {valid[s]}/{len(jc)}" for s in servers))
    for name, by in speed.items():
        if not (by.get("plain") and by.get("tools")):
            continue
        plain = statistics.median(t for t, _ in by["plain"])
        tools = statistics.median(t for t, _ in by["tools"])
        scores["speed_ratio"][name] = tools / plain if plain else 0.0
        lines.append(f"decode {name}: tools declared {tools:.1f} t/s, without {plain:.1f} t/s: {scores['speed_ratio'][name]:.3f}x "
                     f"(tokens {[n for _, n in by['tools']]} / {[n for _, n in by['plain']]})")
    return "\n".join(lines), scores


def save(path: Path, model_path: Path, threads: int, rows: list[tuple[Case, dict[str, Outcome]]], speed: dict) -> None:
    """Every case's outcome on each server and the scores so far, as JSON."""
    servers = list(rows[0][1]) if rows else []
    reader = "llama-server" if "llama-server" in servers else servers[0] if servers else ""
    path.write_text(json.dumps({
        "model": model_path.name, "threads": threads, **report(rows, speed)[1], "speed": speed,
        "cases": [{"id": c.id, "kind": c.kind, "expected": c.expected, "intent": intended(c, o[reader]),
                   **{s: {"passed": passed(c, o[s]), "calls": o[s].calls, "content": o[s].content, "finish": o[s].finish,
                          "completion_tokens": o[s].completion_tokens, "error": o[s].error} for s in servers}} for c, o in rows],
    }, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("edgechat", "llama-server", "both"), default="both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speed-rounds", type=int, default=3, help="rounds of the tools-declared vs plain decode (0: skip)")
    ap.add_argument("--only", help="run only the cases whose id contains this")
    ap.add_argument("--json", type=Path, help="write every case's outcome here")
    ap.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    args = ap.parse_args(argv)

    from bench.realmodel import real_model_path

    model_path = real_model_path()
    todo = [c for c in cases() if not args.only or args.only in c.id]
    which = ("edgechat", "llama-server") if args.server == "both" else (args.server,)
    ports = {s: _free_port() for s in which}
    commands = _commands(model_path, args.threads, ports)
    rows: list[tuple[Case, dict[str, Outcome]]] = []
    speed: dict = {}
    with contextlib.ExitStack() as stack:
        urls = {s: stack.enter_context(_server(commands[s], ports[s], s, args.log_dir)) for s in which}
        clients = {s: openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=900, max_retries=0) for s, url in urls.items()}
        models = {s: c.models.list().data[0].id for s, c in clients.items()}
        for r in range(args.speed_rounds):
            for s in which if r % 2 == 0 else reversed(which):
                for tools in (False, True) if r % 2 == 0 else (True, False):
                    tps, count = decode_tps(clients[s], models[s], tools)
                    speed.setdefault(s, {}).setdefault("tools" if tools else "plain", []).append((tps, count))
                    if args.json:
                        save(args.json, model_path, args.threads, rows, speed)
                    print(f"speed round {r + 1} {s} {'tools' if tools else 'plain'}: {tps:.1f} t/s over {count} tokens", file=sys.stderr, flush=True)
        # the kinds take turns, so a run cut short has measured each of them
        order = sorted(range(len(todo)), key=lambda i: sum(c.kind == todo[i].kind for c in todo[:i]))
        done: dict[int, dict[str, Outcome]] = {}
        for n, i in enumerate(order):
            case, outs = todo[i], {}
            for s in which if n % 2 == 0 else reversed(which):
                t0 = time.monotonic()
                outs[s] = ask(clients[s], models[s], case)
                print(f"[{n + 1}/{len(todo)}] {case.id} {s} {time.monotonic() - t0:.1f}s: {outs[s].show()}", file=sys.stderr, flush=True)
            done[i] = {s: outs[s] for s in which}
            rows = [(todo[k], done[k]) for k in sorted(done)]
            if args.json:
                save(args.json, model_path, args.threads, rows, speed)
    table, scores = report(rows, speed)
    print(table)
    if args.json:
        save(args.json, model_path, args.threads, rows, speed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
