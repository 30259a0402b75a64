"""Command palette (Ctrl+P): every action in the table, run on the chat screen."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from edgechat.tui.actions import ACTIONS, key_label


class ChatCommands(Provider):
    def _run(self, name: str) -> None:
        # The palette is a screen of its own; the actions live on the chat screen under it.
        from edgechat.tui.screens.chat import ChatScreen

        for screen in reversed(self.app.screen_stack):
            if isinstance(screen, ChatScreen):
                self.app.call_later(screen.run_action, f"{name}()")
                return

    def _help(self, action) -> str:
        extra = " · ".join(x for x in (key_label(action.key), action.slash) if x)
        return f"{action.help}" + (f"  ({extra})" if extra else "")

    async def discover(self) -> Hits:
        for action in ACTIONS:
            yield DiscoveryHit(action.title, partial(self._run, action.name), help=self._help(action))

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for action in ACTIONS:
            score = max(matcher.match(action.title), matcher.match(action.slash or "") * 0.9)
            if score > 0:
                yield Hit(
                    score, matcher.highlight(action.title), partial(self._run, action.name), help=self._help(action)
                )
