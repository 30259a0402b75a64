"""The one path from a launched request to its answer, for every API: `stream` (open the response,
keep-alive while it waits, the engine's batches rendered as they come, the end; the generation
cancelled when the client goes away or the deadline passes) and `whole` (wait for every choice;
499 when the client left, 504 past the deadline). An API only renders: a `Wire` of its own turns
each Batch part into its chunks, and writes its errors in its own shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from edgechat.engine.types.request import Finished
from edgechat.server.bridge import Generation, Part, Started, abandon
from edgechat.server.dispatch import Dispatcher, done_within
from edgechat.server.errors import ApiError

#: proxies must pass each event on at once, not buffer the stream
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: an SSE comment every SSE stream sends while a request waits for its turn (and while nothing
#: else is due), so clients and proxies with read timeouts hold on; SSE parsers skip comments
KEEPALIVE = ": keep-alive\n\n"


def sse(payload: dict | str) -> str:
    """One SSE data event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def timed_out() -> ApiError:
    return ApiError(504, "the request timed out and was cancelled", type="timeout", code="timeout")


def failure(finished: Finished) -> ApiError | None:
    """The error of an answer that ended neither by a stop nor by its length (None: it did)."""
    if finished.reason in ("stop", "length"):
        return None
    return ApiError(500, finished.error or f"the generation ended: {finished.reason}", type="server_error", code=finished.reason)


class Wire:
    """How one API writes a streamed answer: each method gives the chunks to send. One per
    response; it may keep what it has sent."""

    media_type = "text/event-stream"
    headers: dict[str, str] | None = SSE_HEADERS
    #: sent while nothing else is due (the request queued, a long prefill); None where the wire
    #: format has no such thing (NDJSON): the response then opens once the request is under way
    keepalive: str | None = KEEPALIVE

    def opened(self, started: Started) -> list[str]:
        """The request is under way: what comes before its first token."""
        return []

    def idle(self) -> list[str]:
        """Nothing came for a keep-alive's time once under way."""
        return [self.keepalive] if self.keepalive else []

    def part(self, part: Part) -> list[str]:
        """A choice's thoughts, text and calls since the last batch."""
        raise NotImplementedError

    def choice_end(self, index: int, finished: Finished) -> list[str]:
        """A choice ended well (before the others, with n choices)."""
        return []

    async def end(self, finished: list[Finished]) -> list[str]:
        """Every choice ended well."""
        raise NotImplementedError

    def error(self, exc: ApiError) -> list[str]:
        """A refusal after the response opened, a timeout, a failed generation: the stream ends."""
        raise NotImplementedError


async def stream(dispatcher: Dispatcher, start: asyncio.Future[Started], wire: Wire) -> Response:
    """The streamed answer of `start` (the dispatcher's launch). A refusal that comes within a
    keep-alive's time (or before the request is under way, where the wire has no keep-alive) is
    the HTTP status; a later one comes in the stream."""
    keepalive = dispatcher.settings.keepalive_s if wire.keepalive is not None else None
    try:
        if await done_within(start, keepalive):
            start.result()  # raises the refusal
    except BaseException:
        abandon(start)
        raise
    return StreamingResponse(_chunks(dispatcher, start, wire, keepalive), media_type=wire.media_type, headers=wire.headers)


async def _chunks(dispatcher: Dispatcher, start: asyncio.Future[Started], wire: Wire, keepalive: float | None) -> AsyncIterator[str]:
    try:
        while wire.keepalive is not None and not await done_within(start, keepalive):
            # its class's share, or the failover's first token, is still to come
            yield wire.keepalive
    except BaseException:
        abandon(start)
        raise
    try:
        started = start.result()
    except ApiError as exc:
        for out in wire.error(exc):
            yield out
        return
    dispatcher.opened(started.request)
    gens = started.gens
    ends: dict[int, Finished] = {}
    try:
        for out in wire.opened(started):
            yield out
        while len(ends) < len(gens):
            batch = await gens[0].batch(keepalive)
            if batch.idle:
                for out in wire.idle():
                    yield out
                continue
            if batch.expired:
                for gen in gens:
                    gen.time_out()
                for out in wire.error(timed_out()):
                    yield out
                return
            for part in batch.parts:
                dispatcher.metrics.tool_calls.inc(len(part.calls))
                for out in wire.part(part):
                    yield out
                if part.finished is None:
                    continue
                if (failed := failure(part.finished)) is not None:
                    for out in wire.error(failed):
                        yield out
                    return
                ends[part.index] = part.finished
                for out in wire.choice_end(part.index, part.finished):
                    yield out
        for out in await wire.end([ends[i] for i in range(len(gens))]):
            yield out
    finally:
        # the client left (the task was cancelled), a timeout or a failure: free the sequences now
        _cancel(gens)


async def whole(dispatcher: Dispatcher, request: Request, start: asyncio.Future[Started]) -> tuple[Started, list[Finished]]:
    """The launched request and every choice's end. A client that leaves first cancels it (a
    499 nobody reads); a failed choice is a 500, the deadline a 504."""
    left: asyncio.Future = asyncio.ensure_future(_disconnected(request))
    try:
        try:
            done, _ = await asyncio.wait({start, left}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            abandon(start)
            raise
        if start not in done:
            abandon(start)
            raise _client_left()
        started = start.result()
        dispatcher.opened(started.request)
        finished = await _wait(started.gens, left, dispatcher.settings.request_timeout)
    finally:
        left.cancel()
    for f in finished:
        if (failed := failure(f)) is not None:
            raise failed
        dispatcher.metrics.tool_calls.inc(len(f.tool_calls))
    return started, finished


async def _wait(gens: list[Generation], left: asyncio.Future, timeout: float) -> list[Finished]:
    # asyncio.wait, not gather: cancelling a gather would cancel the futures the bridge still
    # has to complete (and count) when each Finished arrives
    pending: set[asyncio.Future] = {g.finished for g in gens}
    try:
        while pending:
            done, pending = await asyncio.wait(pending | {left}, timeout=gens[0].remaining(), return_when=asyncio.FIRST_COMPLETED)
            if left in done:
                _cancel(gens)
                raise _client_left()
            pending.discard(left)
            if not done:
                break
    except asyncio.CancelledError:
        # the server is shutting down under us: free the sequences
        _cancel(gens)
        raise
    if pending:
        for gen in gens:
            gen.time_out()
        raise ApiError(504, f"the request did not finish within {timeout:g} s and was cancelled", type="timeout", code="timeout")
    return [g.finished.result() for g in gens]


def _client_left() -> ApiError:
    return ApiError(499, "the client closed the connection", code="client_closed")


def _cancel(gens: list[Generation]) -> None:
    for gen in gens:
        if not gen.finished.done():
            gen.handle.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so only disconnect can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
