"""The chat app (`edgechat` with no command).

app.py (the App: model loading, quitting), screens/chat.py (the main screen, composed of the
parts in chat/: a chat turn, attachments, tools, the context gauge, the slash commands), widgets/
(sidebar, chat view with the streaming worker, prompt, status bar), client.py (LocalClient over
the engine, RemoteClient over any OpenAI-compatible server), actions.py (the one table of keys,
palette entries and slash commands), app.tcss (all styles).
"""
