"""`edgechat run`: one chat turn from the shell, streamed to stdout (or one JSON object).

With `--session NAME` the turn belongs to a stored conversation; its KV snapshot makes the next
turn start without re-reading the history. With `--raw` the prompt is continued as plain text;
with `--suffix TEXT` a code model fills in what goes between the prompt and TEXT (engine/prompt/fim.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import click

from edgechat.attachments import ImageAttachment, read_image
from edgechat.cli.common import data_dir_option, gpu_layers_note, model_option, sampling_options
from edgechat.cli.engine_options import EngineOptions, engine_config, engine_options
from edgechat.cli.sessions import find_session
from edgechat.cli.voice import stt_model_option
from edgechat.config import get_paths
from edgechat.engine.types.request import DEFAULT_MAX_TOKENS, ChatRequest, ContextPolicy, Evicted, Infill, TextDelta
from edgechat.errors import EdgechatError, UsageError
from edgechat.params import SamplingParams, values
from edgechat.store import open_store
from edgechat.store.answer import StoredAnswer
from edgechat.store.history import model_messages, with_system_prompt


def _think(ctx, param, value: str) -> int | None:
    """--think on|off|N as a reasoning budget: None (no limit), 0, or N tokens."""
    if value in ("on", "off"):
        return None if value == "on" else 0
    try:
        budget = int(value)
    except ValueError:
        budget = -1
    if budget < 0:
        raise click.BadParameter(f"use on, off or a number of tokens, not '{value}'")
    return budget


def build_sampling(base: SamplingParams, temperature, top_p, top_k, min_p, repeat_penalty, seed) -> SamplingParams:
    """The options given on the command line laid over `base` (the model's recommended sampling)."""
    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed)
    return dataclasses.replace(base, **{name: value for name, value in given.items() if value is not None})


def _heard(audio: Path, stt_model: str, data_dir: str | None) -> str:
    """What is said in `audio`, shown on stderr as it will be asked."""
    from edgechat.cli.voice import transcribe_file
    from edgechat.engine.speech.models import speech_models

    _, segments = transcribe_file(speech_models(stt_model, None, get_paths(data_dir)), audio)
    heard = "".join(s.text for s in segments).strip()
    click.echo(f"heard: {heard}", err=True)
    return heard


def read_prompt(prompt: str | None) -> str | None:
    """PROMPT, or stdin for '-' or when stdin is piped; None means interactive."""
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    return prompt


@click.command("run")
@model_option
@engine_options
@sampling_options
@click.option("--system", default=None, help="System prompt.")
@click.option("--session", default=None, help="Continue the stored conversation with this id or name (a new name starts one).")
@click.option("--raw", is_flag=True,
              help="Continue PROMPT as plain text, no chat template (base models such as gemma3-270m).")
@click.option("--suffix", default=None, metavar="TEXT",
              help="Fill in the middle: PROMPT is the code before the cursor, TEXT the code after it (a code model's, such as Qwen2.5-Coder).")
@click.option(
    "--context-policy",
    type=click.Choice(values(ContextPolicy)),
    default=None,
    help="When the context is full: shift (default), truncate or summarize.",
)
@click.option("--think", default="on", metavar="on|off|N", callback=_think,
              help="Reasoning models: think as long as they like (on), not at all (off), or at most N tokens.")
@click.option("--hide-thinking", is_flag=True, help="Do not print a reasoning model's thoughts (they go to stderr).")
@click.option("--image", "images", multiple=True, metavar="FILE",
              help="A picture to ask about, before PROMPT (repeatable; a vision model's: see --mmproj).")
@click.option("--audio", default=None, type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="A spoken question (WAV, MP3, ...): written down offline, then answered (after PROMPT, if given; needs edgechat[voice]).")
@stt_model_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.argument("prompt", required=False)
@data_dir_option
def run_cmd(model, options: EngineOptions, temperature, top_p, top_k, min_p, repeat_penalty, seed, max_tokens, stop, ignore_eos,
            loop_guard, system, session, raw, suffix, context_policy, think, hide_thinking, images, audio, stt_model, as_json, prompt, data_dir):
    """Answer PROMPT (or stdin with '-') with a local model. No PROMPT on a terminal: chat interactively."""
    from edgechat.engine import open_engine

    text = prompt if audio is not None and prompt is None else read_prompt(prompt)
    if audio is not None:
        text = "\n\n".join(filter(None, [text, _heard(audio, stt_model, data_dir)]))
    if text is not None and not text.strip():
        raise UsageError("the prompt is empty; pass some text, e.g. edgechat run \"Hello\"")
    plain = "--suffix" if suffix is not None else "--raw" if raw else None
    if plain:
        # plain completion has no roles: nothing to put a system prompt, a stored conversation or a picture in
        for option, given in (("--raw", (raw or None) if suffix is not None else None), ("--system", system), ("--session", session),
                              ("--image", images or None)):
            if given is not None:
                raise UsageError(f"{plain} completes plain text and takes no {option}")
        if text is None:
            raise UsageError(f"{plain} needs a PROMPT argument or stdin")
    if session is not None and text is None:
        raise UsageError("--session needs a MESSAGE argument or stdin")
    if images and text is None:
        raise UsageError("--image needs a PROMPT argument or stdin, e.g. edgechat run --image FILE \"What is this?\"")
    pictures = [_read_image(path) for path in images]
    sampling = functools.partial(build_sampling, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                 repeat_penalty=repeat_penalty, seed=seed)
    params = dict(max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, stop=list(stop),
                  ignore_eos=ignore_eos, loop_guard=loop_guard, reasoning_budget=think)
    gpu_layers_note(options.gpu_layers, options.rpc)
    cfg = engine_config(options, model, get_paths(data_dir))
    if session is not None:
        finished = _session_turn(cfg, session, text, system, context_policy, params, sampling, as_json, not hide_thinking,
                                 pictures)
    else:
        with open_engine(cfg) as engine:
            _warn(engine, plain is not None)
            params["sampling"] = sampling(engine.default_sampling)
            history: list[dict] = [{"role": "system", "content": system}] if system else []
            if text is None:
                _interactive(engine, history, params, not hide_thinking)
                return
            if suffix is not None:
                request = ChatRequest(infill=Infill(text, suffix), **params)
            elif raw:
                request = ChatRequest(prompt=text, **params)
            else:
                content = [*(p.part() for p in pictures), text] if pictures else text
                request = ChatRequest(messages=history + [{"role": "user", "content": content}], **params)
            finished, _ = stream_answer(engine, request, echo=not as_json, thoughts=not hide_thinking)
            if as_json:
                click.echo(json.dumps(result_json(engine, finished), ensure_ascii=False))
    if max_tokens is None:
        _note_cut(finished, params["max_tokens"])
    if finished.reason == "cancelled":
        raise KeyboardInterrupt  # the partial answer is printed (and stored); now exit as interrupted


def _note_cut(finished, max_tokens: int) -> None:
    """An answer cut short by a limit the user did not set says why on stderr (the JSON's
    finish_reason is "length" for both)."""
    if finished.repeating:
        click.echo("edgechat: note: the answer was only repeating itself, so it was stopped "
                   "(--no-loop-guard lets it go on)", err=True)
    elif finished.reason == "length":
        click.echo(f"edgechat: note: the answer reached {max_tokens} tokens (--max-tokens N for more)", err=True)


def _warn(engine, raw: bool = False) -> None:
    """What the user should know about the loaded engine (no chat template, no draft model)."""
    for warning in (None if raw else engine.template_warning, engine.draft_warning):
        if warning:
            click.echo(f"edgechat: warning: {warning}", err=True)


def _read_image(path: str) -> ImageAttachment:
    """--image FILE, read; a one-line UsageError naming the file when it cannot be."""
    try:
        return read_image(Path(path).expanduser())
    except UsageError as exc:
        raise UsageError(f"cannot read --image {path}: {exc}") from None


def _session_turn(cfg, name: str, text: str, system, context_policy, params: dict, sampling, as_json: bool, thoughts: bool,
                  pictures: list[ImageAttachment]):
    """One turn of the stored conversation NAME (its id or its name; created if new). The question
    and an empty "interrupted" answer are stored in one write when it is sent, the answer saved as
    it streams and when it ends: a killed or failed turn leaves both, marked, and store/history.py
    decides what of it later prompts carry. Returns the Finished event."""
    from edgechat.engine import open_engine

    store = open_store(cfg.paths)
    try:
        with open_engine(cfg) as engine:
            _warn(engine)
            if pictures and "vision" not in engine.modalities:
                from edgechat.engine.runners.media import no_vision

                raise UsageError(no_vision(engine.model_name))  # before NAME is created or the turn stored
            conv = find_session(store, name, create=True)
            settings = dict(conv.settings or {})
            if system is not None:
                settings["system_prompt"] = system
            if context_policy is not None:
                settings["context_policy"] = context_policy
            if settings != (conv.settings or {}):
                store.update_conversation(conv.id, settings=settings)
            policy = ContextPolicy(settings.get("context_policy", ContextPolicy.SHIFT.value))
            answer = StoredAnswer.ask(store, conv.id, text, engine.model_name, images=pictures)
            request = ChatRequest(messages=with_system_prompt(settings, model_messages(store, conv.id)),
                                  session=conv.id, context_policy=policy, sampling=sampling(engine.default_sampling), **params)
            try:
                finished, evicted = stream_answer(engine, request, echo=not as_json, answer=answer, thoughts=thoughts)
            except EdgechatError:
                if not answer.text:
                    answer.undo()  # nothing came back (too long, failed): the turn was never asked
                raise
            if as_json:
                m = finished.metrics
                click.echo(json.dumps(result_json(engine, finished, session=name, cached_tokens=m.cached_tokens,
                                                  context_tokens=m.context_tokens, evicted_messages=evicted),
                                      ensure_ascii=False))
            if answer.error is not None:
                # The answer is printed and the store keeps what it could, marked interrupted. The
                # cells hold an answer the store does not: no snapshot of them (nor its room).
                engine.forget_session(conv.id)
                raise answer.error
    finally:
        store.close()
    return finished


def stream_answer(engine, request: ChatRequest, echo: bool, answer: StoredAnswer | None = None, thoughts: bool = True):
    """Submit and print text as it comes, each piece handed to `answer` (the store) before it is
    printed; a reasoning model's thoughts go to stderr (dimmed on a terminal; not with
    `thoughts` False) and to the store apart from the answer. Ctrl+C cancels the generation and returns the partial
    answer (reason "cancelled"). Returns (Finished, messages evicted from the context)."""
    handle = engine.submit(request)
    evicted = 0
    dim, thought = sys.stderr.isatty(), False
    try:
        # a terminal needs no more than ~30 updates a second; fewer wake-ups leave the CPU to llama.cpp
        for event in handle.events(every=0.033):
            if isinstance(event, TextDelta) and event.reasoning:
                if answer is not None:
                    answer.append(event.text, reasoning=True)  # stored apart from the answer
                if echo and thoughts:
                    click.echo(click.style(event.text, dim=True) if dim else event.text, err=True, nl=False)
                    thought = True
            elif isinstance(event, TextDelta):
                if thought:
                    click.echo("", err=True)  # the thoughts end on their own line
                    thought = False
                if answer is not None:
                    answer.append(event.text)
                if echo:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            elif isinstance(event, Evicted):
                evicted += event.messages
                click.echo(f"\nedgechat: {event.note}", err=True)
    except KeyboardInterrupt:
        handle.cancel()
        handle.result()
    if echo:
        sys.stdout.write("\n")
        sys.stdout.flush()
    finished = handle.finished
    if answer is not None:
        answer.finish(finished)
    if finished.reason == "error":
        raise UsageError(f"generation failed: {finished.error}")
    return finished, evicted


def result_json(engine, finished, **extra) -> dict:
    m = finished.metrics
    return {
        "text": finished.text,
        "model": engine.model_name,
        "device": engine.gpu.describe(),
        "finish_reason": finished.reason,
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": m.completion_tokens,
        "reasoning": finished.reasoning or None,
        "reasoning_tokens": m.reasoning_tokens,
        "ttft_ms": round(m.ttft * 1000, 2),
        "prefill_tps": round(m.prefill_tps, 2),
        "decode_tps": round(m.decode_tps, 2),
        "drafted_tokens": m.drafted_tokens,
        "accepted_tokens": m.accepted_tokens,
        "acceptance": round(m.accepted_tokens / m.drafted_tokens, 3) if m.drafted_tokens else None,
        **extra,
    }


def _interactive(engine, history, params: dict, thoughts: bool) -> None:
    click.echo(f"{engine.model_name} ({engine.n_ctx}-token context). Empty line or Ctrl+D quits.", err=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if not line.strip():
            return
        history.append({"role": "user", "content": line})
        request = ChatRequest(messages=list(history), session="interactive", **params)
        finished, _ = stream_answer(engine, request, echo=True, thoughts=thoughts)
        history.append({"role": "assistant", "content": finished.text})
