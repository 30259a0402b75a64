"""The README is the front door: every `edgechat` command and `--flag` it names exists in that
command's `--help`, its quick start is the two commands CI runs, the pages a user reads say
nothing about how the work was done, and their relative links lead somewhere."""

from __future__ import annotations

import re
import shlex
from functools import cache
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from edgechat.cli import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
USER_PAGES = [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY_WORDS = re.compile(r"\b(?:this stop|last stop|stops? ago|a helper|this session|last session)\b", re.IGNORECASE)
#: programs other than edgechat whose flags a page may name beside them
OTHER_PROGRAMS = {"bash", "sh", "pip", "python", "curl", "llama-server", "llama-bench", "llama-quantize", "pkg"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
CODE_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _words(snippet: str) -> list[str]:
    # a table cell escapes its pipes; what remains is shell words
    return shlex.split(snippet.replace(r"\|", "|"), comments=True)


@cache
def _help(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, f"edgechat {' '.join(path)} --help: {result.output}"
    return result.output


def _resolve(args: list[str]) -> tuple[str, ...]:
    """The subcommand path that `edgechat ARGS` runs, as click parses it (a group's own argument
    handling included); click.UsageError for an unknown command or option."""
    ctx = cli.make_context("edgechat", list(args), resilient_parsing=True)
    command: click.Command = cli
    while isinstance(command, click.Group):
        # click 8.2 renamed protected_args (the subcommand and what follows it)
        protected = vars(ctx)["_protected_args"] if "_protected_args" in vars(ctx) else ctx.protected_args
        args = [*protected, *ctx.args]
        if not args:
            break
        name, sub, rest = command.resolve_command(ctx, args)
        if name is None or sub is None:  # resilient parsing leaves an unknown command to the caller
            raise click.UsageError(f"`{ctx.command_path}` has no command {args[0]!r}")
        ctx = sub.make_context(name, rest, parent=ctx, resilient_parsing=True)
        command = sub
    return tuple(ctx.command_path.split()[1:])


def _has_flag(path: tuple[str, ...], flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", _help(path)) is not None


@cache
def _all_paths() -> tuple[tuple[str, ...], ...]:
    def walk(command: click.Command, path: tuple[str, ...]):
        yield path
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, (*path, name))
    return tuple(walk(cli, ()))


def _blocks(text: str) -> list[list[str]]:
    """Paragraphs and table rows outside code blocks, each as its code spans in order; every
    line of a code block as one span of its own."""
    blocks = [[line] for block in CODE_BLOCK.findall(text) for line in block.splitlines()]
    prose = CODE_BLOCK.sub("", text)
    for paragraph in re.split(r"\n\s*\n", prose):
        rows = paragraph.splitlines() if paragraph.lstrip().startswith("|") else [paragraph]
        blocks += [CODE_SPAN.findall(row) for row in rows]
    return blocks


def command_problems(text: str) -> list[str]:
    """Every `edgechat ...` the text names, and every bare `--flag` (its owner the command named
    before it in the same paragraph or table row, else any edgechat command), against --help."""
    problems = []
    for spans in _blocks(text):
        owner: tuple[str, ...] | str | None = None  # the last command named here: its path, or "other"
        for span in spans:
            try:
                words = _words(span)
            except ValueError:
                continue  # not shell words (a fragment of JSON, an open quote)
            if not words:
                continue
            if words[0] == "edgechat":
                try:
                    owner = _resolve(words[1:])
                except click.UsageError as e:
                    problems.append(f"`{span}`: {e.format_message()}")
                    owner = "other"
                    continue
                # a code line's comment may name the command's flags too
                flags = [w.split("=", 1)[0] for w in words if FLAG.fullmatch(w.split("=", 1)[0])]
                flags += FLAG.findall(span.split("#", 1)[1]) if "#" in span else []
                problems += [f"`{span}`: `edgechat {' '.join(owner)} --help` has no {flag}"
                             for flag in flags if not _has_flag(owner, flag)]
            elif words[0] in OTHER_PROGRAMS:
                owner = "other"
            elif FLAG.fullmatch(words[0]):
                if owner is None and not any(_has_flag(path, words[0]) for path in _all_paths()):
                    problems.append(f"`{span}`: no edgechat command has {words[0]}")
                elif isinstance(owner, tuple) and not _has_flag(owner, words[0]):
                    problems.append(f"`{span}`: `edgechat {' '.join(owner)} --help` has no {words[0]}")
    return problems


def _commands(block: str) -> list[list[str]]:
    """A shell line's commands: its words split on `&&`."""
    commands: list[list[str]] = [[]]
    for word in _words(block):
        commands.append([]) if word == "&&" else commands[-1].append(word)
    return commands


def quick_start(text: str) -> list[str]:
    """The command lines of the README's quick start (its first code block)."""
    section = text.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    block = CODE_BLOCK.search(section)
    assert block, "the quick start has no code block"
    return [line for line in block.group(1).splitlines() if _words(line)]


def quick_start_problems(text: str, ci_script: str) -> list[str]:
    lines = quick_start(text)
    if len(lines) != 2:
        return [f"the quick start is {len(lines)} commands, not two: {lines}"]
    ci = [_words(line) for line in ci_script.splitlines() if not line.startswith("#") and _words(line)]
    ci_install = next(w for w in ci if w[:4] == ["python", "-m", "pip", "install"] and "--upgrade" not in w)
    ci_pytest = next(w for w in ci if w[:3] == ["python", "-m", "pytest"])
    # CI asks pytest for the slowest tests too: a report, not another suite
    suite = [["pip", "install", *ci_install[4:]], [w for w in ci_pytest if not w.startswith("--durations")]]
    problems = []
    if _commands(lines[0]) != [["pip", "install", "."], ["edgechat"]]:
        problems.append(f"the first quick-start command should install and open the chat app: {lines[0]!r}")
    if _commands(lines[1]) != suite:
        problems.append(f"the second quick-start command {lines[1]!r} is not what .ci/run runs: "
                        f"{' '.join(ci_install)} and {' '.join(ci_pytest)}")
    return problems


def history_problems(text: str, name: str) -> list[str]:
    return [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in HISTORY_WORDS.finditer(text)]


def link_problems(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(CODE_BLOCK.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or a place on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            problems.append(f"{page.relative_to(ROOT)}: ({target}) leads nowhere")
    return problems


def test_every_command_and_flag_the_readme_names_exists():
    assert command_problems(README.read_text()) == []


def test_a_command_or_flag_that_does_not_exist_is_found():
    found = command_problems("Run `edgechat chatter`, then `edgechat serve --no-such-flag`.\n\n"
                             "| `edgechat run PROMPT` | (`--sessionz NAME`) |\n\n`--never-a-flag` alone, "
                             "but `bash packaging/termux.sh` takes `--dry-run`\n")
    assert [p.split("`")[1] for p in found] == ["edgechat chatter", "edgechat serve --no-such-flag",
                                                "--sessionz NAME", "--never-a-flag"]


def test_the_quick_start_is_the_two_commands_ci_runs():
    assert quick_start_problems(README.read_text(), (ROOT / ".ci" / "run").read_text()) == []


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_words_about_how_the_work_was_done(page):
    assert history_problems(page.read_text(), str(page.relative_to(ROOT))) == []


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(page):
    assert link_problems(page) == []
