"""The chat screen's parts, one job each: objects with their own state that `screens/chat.py`'s
`ChatScreen` holds and hands its keys, commands and messages to. A part reaches the screen's
shared state through `ChatBase` and another part only through that part's public methods.

base.py (the state, widgets and helpers every part shares), turn.py (a chat turn: sending,
streaming an answer into its box, finishing, stopping, undo, regenerate, edit), attachments.py
(files and pictures above the input), tools.py (the tools offered to an answer, approving and
running its calls, `/tools`), gauge.py (the context gauge in the status bar), commands.py (the
slash commands and keys not owned by another part: conversations, settings, presets, the model,
export, copying, what is shown).
"""
