"""Every user action in one table: key bindings, the command palette, slash commands and help come from it."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    name: str  # the screen's action_<name>
    title: str
    help: str
    key: str | None = None
    slash: str | None = None
    #: what the slash command takes after it, for help ("" = nothing)
    arg: str = ""
    #: a word for the footer of main keys ("" = not shown there)
    hint: str = ""


ACTIONS: list[Action] = [
    Action("new", "New conversation", "Start an empty conversation", "ctrl+n", "/new", hint="New"),
    Action("stop", "Stop generating", "Stop the answer and put the prompt back in the input", "escape", hint="Stop"),
    Action("regenerate", "Regenerate answer", "Answer the last message again", "ctrl+r", "/regen"),
    Action("edit_last", "Edit and resend", "Edit your last message and send it again", "ctrl+g", "/edit"),
    Action("branch", "Branch conversation", "Fork the conversation at the selected (or last) message", None, "/branch"),
    Action("rename", "Rename conversation", "Give the conversation a title", "f2", "/rename", "TITLE"),
    Action(
        "delete", "Delete conversation", "Delete the conversation (asks first; /undo brings it back)", None, "/delete"
    ),
    Action("undo", "Undo delete", "Bring back the last deleted conversation", None, "/undo"),
    Action(
        "search",
        "Search conversations",
        "Full-text search across every conversation",
        "ctrl+f",
        "/search",
        "WORDS",
        hint="Search",
    ),
    Action(
        "settings",
        "Conversation settings",
        "System prompt, sampling (temperature, top-k/p, min-p, penalties), max tokens, seed, thinking, context policy",
        "f4",
        "/settings",
    ),
    Action(
        "preset",
        "Apply a preset",
        "System prompt, sampling, model and thinking from a named preset ([presets.NAME] in config.toml)",
        None,
        "/preset",
        "NAME",
    ),
    Action(
        "tools",
        "Tools (MCP)",
        "List the MCP servers' tools; /tools on SERVER.TOOL… or off … in this conversation; /tools required or auto",
        None,
        "/tools",
        "[on|off NAME…]",
    ),
    Action("system", "Set system prompt", "Set this conversation's system prompt", None, "/system", "TEXT"),
    Action("model", "Switch model", "Pick or load a model (name or .gguf path)", "ctrl+o", "/model", "NAME", hint="Model"),
    Action(
        "export",
        "Export conversation",
        "Write it as Markdown, or JSON with /export json or a .json path",
        None,
        "/export",
        "[json|PATH]",
    ),
    Action(
        "attach",
        "Attach files",
        "Send files with the next message: paths, globs, folders (text, code, Markdown, JSON/CSV, PDF, images)",
        "ctrl+l",
        "/attach",
        "PATH…",
    ),
    Action("image", "Attach an image", "Send a picture with the next message (a vision model's: PNG, JPEG, GIF, "
           "WebP, BMP; images are among /attach's files too)", None, "/image", "PATH"),
    Action("detach", "Remove attachments", "Take the attachments off the next message (or the one named)", None,
           "/detach", "[NAME]"),
    Action("talk", "Talk", "Speak a question: records from the microphone until pressed again, then writes it into "
           "the input (offline Whisper, the voice extra)", "f5", "/talk"),
    Action("speak", "Read answers aloud", "Read each answer aloud as it streams, sentence by sentence (Esc silences it)",
           "f6", "/speak", "[on|off]"),
    Action("clear", "Clear conversation", "Remove every message of this conversation (asks first)", None, "/clear"),
    Action("copy", "Copy last answer", "Copy the last answer to the clipboard", "ctrl+y", "/copy"),
    Action("copy_code", "Copy last code block", "Copy the last code block to the clipboard", None, "/copycode"),
    Action("toggle_sidebar", "Toggle sidebar", "Show or hide the conversation list", "ctrl+b", "/sidebar"),
    Action("toggle_stats", "Toggle stats", "Show timestamps and per-answer TTFT and tok/s", "ctrl+t", "/stats"),
    Action("toggle_thoughts", "Show or hide thoughts", "Expand or collapse the thoughts of the selected (or last) answer",
           "f3", "/thoughts"),
    Action("theme", "Change theme", "Pick a theme (remembered)", None, "/theme", "NAME"),
    Action("help", "Help", "Keys and slash commands", "f1", "/help", hint="Help"),
    Action("quit", "Quit", "Leave edgechat (everything is saved)", "ctrl+q", "/quit", hint="Quit"),
]

BY_SLASH = {a.slash: a for a in ACTIONS if a.slash}
#: "/word" or "/word args" on one line: meant as a command (a path like /usr/bin is not)
_COMMAND_SHAPE = re.compile(r"/[A-Za-z]+(?: .*)?")


def parse_slash(text: str) -> tuple[Action, str] | None:
    """'/model gemma3' -> (the model action, 'gemma3'); None when text is not a known slash command."""
    if not text.startswith("/"):
        return None
    word, _, rest = text.strip().partition(" ")
    action = BY_SLASH.get(word.lower())
    return (action, rest.strip()) if action else None


def unknown_slash(text: str) -> str | None:
    """The command word when `text` looks like a slash command that does not exist, else None."""
    text = text.strip()
    if _COMMAND_SHAPE.fullmatch(text) and parse_slash(text) is None:
        return text.split(" ", 1)[0]
    return None


def key_label(key: str | None) -> str:
    """'ctrl+n' -> 'Ctrl+N', 'escape' -> 'Esc', 'f1' -> 'F1'."""
    if not key:
        return ""
    names = {"escape": "Esc", "ctrl": "Ctrl"}
    return "+".join(names.get(p, p.upper() if len(p) <= 3 else p.capitalize()) for p in key.split("+"))
