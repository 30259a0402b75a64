"""Prompt preparation: a ChatRequest becomes the tokens the model is given, with the spans of its
messages and what eviction left out. Pure: it needs a chat format and a tokenizer, not a model,
and its cost grows linearly with the number of messages.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from edgechat.engine.kv.kvcache import is_sentinel
from edgechat.engine.output.tools import tool_messages
from edgechat.engine.prompt.templates import ChatFormat, validate_messages
from edgechat.engine.types.request import ChatRequest, ContextPolicy, ImageInput
from edgechat.errors import PromptTooLongError, UsageError
from edgechat.params import SamplingParams, check_sampling

if TYPE_CHECKING:
    from edgechat.engine.kv.sessions import Conversations
    from edgechat.engine.prompt.fim import InfillBuilder
    from edgechat.engine.runners.media import MediaChunk, Projector

#: share of the context kept free for the answer when a request sets no max_tokens
ANSWER_RESERVE = 0.25
#: how a summary of evicted messages is introduced to the model
SUMMARY_PREFIX = "Summary of the earlier conversation: "
#: what the model is asked to do with the messages that leave the context
SUMMARY_REQUEST = "Summarize this conversation in two or three sentences, keeping names and facts:"
#: rendered messages whose tokens are remembered: a chat, or an agent resending its growing
#: history, tokenizes only its new messages (llama.cpp takes ~70 us per message on a 2-core CPU)
TOKEN_CACHE_ENTRIES = 16384
#: pictures whose chunks are kept (by the sha256 of their bytes): a conversation sends its
#: images again every turn, and reading and resizing one costs more than tokenizing a message
#: (each entry holds the resized picture: Gemma 3's 896x896 is ~10 MB)
IMAGE_CACHE_ENTRIES = 4
#: what a summary or a token estimate reads where a message had a picture
IMAGE_PLACEHOLDER = "[image]"


@dataclass(frozen=True)
class Prepared:
    """A built prompt, read by everyone and changed by no one: a request's `n` choices share one
    (the scheduler keeps each run's own copy of the spans it moves when it makes room; the
    tokens are copied wherever they are kept)."""

    tokens: list[int]
    keep: int  # tokens of the pinned prefix (never evicted)
    spans: tuple[tuple[int, int], ...]  # (start, length) of each evictable message, oldest first
    evicted_total: int  # messages of the conversation left out of the prompt
    evicted_now: int  # of which newly left out by this request
    summary: str | None = None  # what the model wrote of them (summarize policy)
    #: a reasoning model's prompt ends inside an open thinking block (its generation prompt opened it)
    thinking: bool = False
    #: the pictures in `tokens`: each one's first sentinel (engine/runners/media.py) -> its chunk
    media: Mapping[int, MediaChunk] = field(default_factory=dict)


@dataclass(frozen=True)
class _Chat:
    """A chat request being fitted: its messages as the template takes them, how many lead pinned,
    its template variables, and what earlier turns of its conversation evicted and summarized."""

    request: ChatRequest
    msgs: list[dict]
    keep_msgs: int
    variables: dict
    already: int
    summary: str | None
    limit: int


class _Fitted(NamedTuple):
    retained: list[dict]
    seg_tokens: list[list[int]]
    pinned: int  # leading messages never evicted (the summary's included)
    evicted: int
    tail: str  # the last segment's text
    media: dict[int, MediaChunk]


@dataclass(frozen=True)
class SummaryNeeded:
    """A chat prompt that waits for the model (the summarize policy): messages leave the context,
    and what the model writes of them stays pinned in their place. The engine runs `request()`
    as any request and gives its text to `PromptBuilder.summarized`, which finishes the prompt."""

    leaving: list[dict]  # the messages leaving now, as a summary reads them
    evicted: int
    check_limit: bool
    chat: _Chat

    @property
    def previous(self) -> str | None:
        """The summary of what left before, kept where the model writes none."""
        return self.chat.summary

    def request(self, n_ctx: int) -> ChatRequest:
        lines = [f"Earlier summary: {self.previous}"] if self.previous else []
        lines += [f"{m['role']}: {m['content']}" for m in self.leaving]
        transcript = "\n".join(lines)[-n_ctx:]  # characters, a safe bound on tokens
        return ChatRequest(
            messages=[{"role": "user", "content": f"{SUMMARY_REQUEST}\n\n{transcript}"}],
            sampling=SamplingParams(temperature=0),
            max_tokens=min(128, n_ctx // 8),
        )


class PromptBuilder:
    """Renders, tokenizes and fits requests for one model and context size.

    `tokenize(text)` parses special tokens and adds no BOS; `bos` is prepended when the model
    wants one and the template did not write it. `conversations` give a session's eviction state
    ({"evicted": n, "summary": text}); `projector` reads a message's pictures; `infill` builds
    fills. Where the summarize policy needs the model, `prepare` returns a SummaryNeeded.
    """

    def __init__(
        self,
        fmt: ChatFormat,
        tokenize: Callable[[str], list[int]],
        *,
        bos: int | None,
        n_ctx: int,
        conversations: Conversations | None = None,
        projector: Projector | None = None,
        model_name: str = "this model",
        infill: InfillBuilder | None = None,
        n_vocab: int | None = None,
    ):
        self.format = fmt
        self.n_vocab = n_vocab
        self.infill = infill
        self.projector = projector
        self.model_name = model_name
        self._image_cache: OrderedDict[str, list] = OrderedDict()
        self._tokenize = tokenize
        self.bos = bos
        self.n_ctx = n_ctx
        self.conversations = conversations
        self._token_cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_lock = threading.Lock()  # submit() runs on any thread

    def limit(self, request: ChatRequest) -> int:
        """Prompt tokens allowed: the context minus what is kept for the answer."""
        share = int(self.n_ctx * ANSWER_RESERVE)
        reserve = min(request.max_tokens, share) if request.max_tokens else share
        return self.n_ctx - reserve

    def prepare(self, request: ChatRequest, policy: ContextPolicy, check_limit: bool = True) -> Prepared | SummaryNeeded:
        check_sampling(request.sampling, self.n_vocab)
        if request.max_tokens is not None and request.max_tokens < 1:
            raise UsageError(f"max_tokens must be at least 1 (got {request.max_tokens})")
        if request.ignore_eos and request.max_tokens is None:
            raise UsageError("ignore_eos needs max_tokens, or the answer would never end (add --max-tokens N)")
        limit = self.limit(request)
        if request.infill is not None:
            if self.infill is None:
                raise UsageError(f"{self.model_name} cannot fill in the middle here")
            prep = Prepared(self.infill.tokens(request.infill, self.n_ctx, limit), 0, (), 0, 0)
        elif request.messages is None:
            text = request.prompt or ""
            if not text.strip():
                raise UsageError("the prompt is empty; type a message")
            prep = Prepared(self.tokens_for([text])[0], 0, (), 0, 0)
        else:
            chat = self._prepare_chat(request, policy, limit, check_limit)
            if isinstance(chat, SummaryNeeded):
                return chat
            prep = chat
        return self._checked(request, prep, check_limit)

    def summarized(self, need: SummaryNeeded, summary: str | None) -> Prepared:
        """The prompt `need` waited for, with `summary` (the model's, or the previous one where it
        wrote none) pinned in place of every evicted message."""
        chat = need.chat
        fitted = self._fit(chat, need.evicted, summary, chat.limit)
        return self._checked(chat.request, self._assemble(chat, fitted, summary), need.check_limit)

    def _checked(self, request: ChatRequest, prep: Prepared, check_limit: bool) -> Prepared:
        if prep.tokens and is_sentinel(prep.tokens[-1]):
            # the answer's first token is read from the logits after the prompt's last token
            raise UsageError("the prompt ends with an image; write the question after it")
        if check_limit:
            self.check(request, prep)
        return prep

    def check(self, request: ChatRequest, prep: Prepared) -> None:
        """Refuse a prompt that leaves too little of the context for the request's answer."""
        limit = self.limit(request)
        if len(prep.tokens) > limit:
            raise PromptTooLongError(
                f"the prompt is {len(prep.tokens)} tokens but this context allows {limit} "
                f"({self.n_ctx} minus {self.n_ctx - limit} kept for the answer); shorten it, "
                f"lower max_tokens or raise the context with --ctx",
                len(prep.tokens),
                limit,
            )

    def tokens_for(self, segments: list[str], images: list[ImageInput] | None = None,
                   media: dict[int, MediaChunk] | None = None) -> list[list[int]]:
        """Tokens of each segment (lists shared with the cache: never modify them). With
        `images`, each projector marker in the segments is the next picture: its chunks'
        tokens and sentinels stand there, and `media` gets the chunks by first sentinel."""
        if images:
            assert self.projector is not None and media is not None  # _split_images refused them otherwise
            pictures = iter(images)
            out = [self._media_tokens(s, pictures, media) if self.projector.marker in s else self._segment_tokens(s)
                   for s in segments]
            if next(pictures, None) is not None:
                raise UsageError("this model's chat template left some images out of the prompt; send them in user messages")
        else:
            out = [self._segment_tokens(s) for s in segments]
        if self.bos is not None and (not out[0] or out[0][0] != self.bos):
            out[0] = [self.bos] + out[0]
        return out

    def _media_tokens(self, segment: str, pictures: Iterator[ImageInput], media: dict[int, MediaChunk]) -> list[int]:
        """A rendered segment with pictures: its text tokenized as any segment's, each marker
        replaced by the picture's chunks (the projector's own text around it, such as Gemma 3's
        <start_of_image>, and a sentinel per image cell)."""
        from edgechat.engine.runners.media import sentinels

        assert self.projector is not None
        marker = self.projector.marker
        first, *rest = segment.split(marker)
        tokens = list(self._segment_tokens(first)) if first else []
        for text in rest:
            picture = next(pictures, None)
            if picture is None:
                raise UsageError(f"a message holds the image marker text {marker} with no image for it; remove it")
            for chunk in self._image_chunks(picture):
                if isinstance(chunk, list):
                    tokens += chunk
                else:
                    run = sentinels(chunk)
                    media[run[0]] = chunk
                    tokens += run
            if text:
                tokens += self._segment_tokens(text)
        return tokens

    def _image_chunks(self, picture: ImageInput) -> list:
        """The projector's chunks for one picture (decoded and resized once while it is sent)."""
        assert self.projector is not None
        key = hashlib.sha256(picture.data).hexdigest()
        with self._cache_lock:
            chunks = self._image_cache.get(key)
            if chunks is not None:
                self._image_cache.move_to_end(key)
                return chunks
        chunks = self.projector.chunks(self.projector.marker, [self.projector.image(picture.data, key)], add_special=False)
        with self._cache_lock:
            self._image_cache[key] = chunks
            if len(self._image_cache) > IMAGE_CACHE_ENTRIES:
                self._image_cache.popitem(last=False)
        return chunks

    def _split_images(self, messages: list[dict]) -> list[dict]:
        """Messages whose content is a list of parts become text with the projector's marker
        where each picture stands, the pictures kept beside it (`images`); a model without a
        projector refuses them."""
        out = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list):
                out.append(m)
                continue
            images = [part for part in content if isinstance(part, ImageInput)]
            if any(not isinstance(part, str | ImageInput) for part in content):
                raise UsageError(f"message {i}'s content parts must be text or images")
            if images and (self.projector is None or not self.projector.vision):
                from edgechat.engine.runners.media import no_vision

                raise UsageError(no_vision(self.model_name))
            marker = self.projector.marker if self.projector is not None else ""
            text = "".join(part if isinstance(part, str) else marker for part in content)
            out.append({**m, "content": text, "images": images} if images else {**m, "content": text})
        return out

    def _segment_tokens(self, text: str) -> list[int]:
        cache = self._token_cache
        with self._cache_lock:
            tokens = cache.get(text)
            if tokens is not None:
                cache.move_to_end(text)
                return tokens
        tokens = self._tokenize(text)
        with self._cache_lock:
            cache[text] = tokens
            if len(cache) > TOKEN_CACHE_ENTRIES:
                cache.popitem(last=False)
        return tokens

    def segments(self, messages: list[dict], variables: dict | None = None) -> list[str]:
        if self.format.mode == "completion":
            return ["\n\n".join(m["content"] for m in messages)]
        return self.format.segments(messages, **(variables or {}))

    def text(self, request: ChatRequest, generation_prompt: bool = True) -> str:
        """A chat request's whole prompt as text, rendered as `prepare` renders it (before any
        eviction; without the assistant's opening if not `generation_prompt`): what
        llama-server's /apply-template gives."""
        if request.messages is None:
            raise UsageError("a raw prompt has no chat template to apply; send messages")
        msgs, variables = self._chat_messages(request)
        return self.format.render(msgs, generation_prompt, **variables)

    def _chat_messages(self, request: ChatRequest) -> tuple[list[dict], dict]:
        """The messages and template variables a chat request renders: earlier thoughts left
        out, tools, calls and results as the template takes them."""
        msgs = validate_messages(self._split_images(request.messages or []))
        fmt = self.format.reasoning
        if fmt is not None:
            # earlier thoughts are not sent again: they would fill the context with old reasoning
            msgs = [{**m, "content": fmt.strip_thoughts(m["content"])} if m["role"] == "assistant" else m for m in msgs]
        variables = self._variables(request)
        if request.tools is not None or any(m["role"] == "tool" or "tool_calls" in m for m in msgs):
            # the tools, calls and results as the template takes them (or in the generic format),
            # still one message each, so eviction keeps to message boundaries
            msgs, tool_variables = tool_messages(msgs, request.tools, self.format.tool_family)
            variables.update(tool_variables)
        return msgs, variables

    def _variables(self, request: ChatRequest) -> dict:
        """The template's variables: the request's own, and the thinking switch where the
        template has one, set both ways: some templates (llama.cpp's DeepSeek-R1 ones) close the
        thinking block unless the switch is set, others open it unless it is false."""
        variables = dict(request.template_kwargs)
        fmt = self.format.reasoning
        if fmt is not None and fmt.switch:
            variables.setdefault(fmt.switch, request.reasoning_budget != 0)
        return variables

    def _prepare_chat(self, request: ChatRequest, policy: ContextPolicy, limit: int,
                      check_limit: bool) -> Prepared | SummaryNeeded:
        msgs, variables = self._chat_messages(request)
        # the pinned prefix: leading system messages and leading pinned ones
        keep_msgs = 0
        while keep_msgs < len(msgs) - 1 and (msgs[keep_msgs]["role"] == "system" or keep_msgs in request.pinned):
            keep_msgs += 1
        state = self.conversations.state(request.session) if request.session and self.conversations else {}
        already = min(state.get("evicted", 0), max(len(msgs) - 1 - keep_msgs, 0))
        chat = _Chat(request, msgs, keep_msgs, variables, already, state.get("summary") if already else None, limit)
        fitted = self._fit(chat, already, chat.summary, limit)
        if fitted.evicted > already and policy is not ContextPolicy.SHIFT:
            # truncate and summarize recompute what follows the cut: cut deeper, so that happens rarely
            fitted = self._fit(chat, already, chat.summary, limit // 2)
        if fitted.evicted > already and policy is ContextPolicy.SUMMARIZE:
            # the model condenses what leaves the context; the summary stays pinned in its place
            leaving = [self._as_text(m) for m in msgs[keep_msgs + already : keep_msgs + fitted.evicted]]
            return SummaryNeeded(leaving, fitted.evicted, check_limit, chat)
        return self._assemble(chat, fitted, chat.summary)

    def _assemble(self, chat: _Chat, fitted: _Fitted, summary: str | None) -> Prepared:
        """The prompt from a fit: its tokens, the pinned prefix's length, each evictable message's
        span, and the thoughts closed or opened as the request asks."""
        request, fmt = chat.request, self.format.reasoning
        tokens: list[int] = []
        spans: list[tuple[int, int]] = []
        keep = 0
        retained, tail = fitted.retained, fitted.tail
        segmented = len(fitted.seg_tokens) == len(retained) + 1  # one segment per message, then the generation prompt
        for i, st in enumerate(fitted.seg_tokens):
            if segmented and fitted.pinned <= i < len(retained) - 1:
                spans.append((len(tokens), len(st)))
            tokens += st
            if segmented and i < fitted.pinned:
                keep = len(tokens)
        if fmt is not None and request.split_reasoning and request.reasoning_budget == 0 and (skip := fmt.skip(tail)):
            # no switch in the template: the prompt itself closes (or skips) the thoughts
            tokens = tokens + self._segment_tokens(skip)
            tail += skip
        thinking = fmt is not None and request.split_reasoning and fmt.opened_by(tail)
        evicted = fitted.evicted
        return Prepared(tokens, keep, tuple(spans), evicted, evicted - chat.already, summary, thinking, fitted.media)

    def _as_text(self, message: dict) -> dict:
        """A message as a summary reads it: its pictures as a placeholder."""
        if "images" not in message or self.projector is None:
            return message
        text = message["content"].replace(self.projector.marker, IMAGE_PLACEHOLDER)
        return {k: v for k, v in message.items() if k != "images"} | {"content": text}

    def _fit(self, chat: _Chat, evicted: int, summary: str | None, limit: int) -> _Fitted:
        """Leave out the oldest unpinned messages (sessions only) until the prompt fits."""
        msgs, keep_msgs = chat.msgs, chat.keep_msgs
        can_evict = chat.request.session is not None
        extra = [{"role": "system", "content": f"{SUMMARY_PREFIX}{summary}"}] if summary else []
        last = len(msgs) - 1  # the newest message always stays
        if can_evict:
            evicted = max(evicted, self._estimate_eviction(msgs, keep_msgs, limit))
        evicted = min(evicted, max(last - keep_msgs, 0))
        while True:
            # a tool's results leave with the call they answer: a template may refuse them alone
            while evicted and keep_msgs + evicted < last and msgs[keep_msgs + evicted]["role"] == "tool":
                evicted += 1
            retained = msgs[:keep_msgs] + extra + msgs[keep_msgs + evicted :]
            segments = self.segments(retained, chat.variables)
            media: dict[int, MediaChunk] = {}
            seg_tokens = self.tokens_for(segments, [image for m in retained for image in m.get("images", ())], media)
            total = sum(len(t) for t in seg_tokens)
            if total <= limit or not can_evict or keep_msgs + evicted >= last:
                return _Fitted(retained, seg_tokens, keep_msgs + len(extra), evicted, segments[-1], media)
            # drop as many of the oldest unpinned messages as cover the excess, in one go; a
            # template that renders the prompt as one piece is measured message by message
            excess, first = total - limit, keep_msgs + len(extra)
            if len(seg_tokens) == len(retained) + 1:
                sizes = (len(st) for st in seg_tokens[first : len(retained) - 1])
            else:
                sizes = (self._message_cost(m) for m in retained[first:-1])
            for size in sizes:
                evicted += 1
                excess -= size
                if excess <= 0:
                    break
            evicted = min(evicted, last - keep_msgs)

    def _estimate_eviction(self, msgs: list[dict], keep_msgs: int, limit: int) -> int:
        """A cheap lower bound on how many old messages must go, so a long history is not
        re-rendered once per evicted message (each message counted alone plus a small framing)."""
        if len(msgs) < 32:
            return 0
        budget = limit - sum(self._message_cost(m) for m in msgs[:keep_msgs])
        used = 0
        for i in range(len(msgs) - 1, keep_msgs - 1, -1):
            used += self._message_cost(msgs[i])
            if used > budget:
                return max(i + 1 - keep_msgs, 0)
        return 0

    def _message_cost(self, message: dict) -> int:
        return len(self._tokenize(self._as_text(message)["content"])) + self._framing

    @functools.cached_property
    def _framing(self) -> int:
        """Tokens the template adds around one message's content (role markers, separators)."""
        probe = [{"role": "system", "content": "x"}, {"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        segs = self.segments(probe)
        if len(segs) != len(probe) + 1:
            return 0
        return max(len(self._tokenize(segs[1])) - len(self._tokenize("x")), 0)
