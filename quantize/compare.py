"""Two GGUFs of one model side by side on the user's own prompts.

Each prompt (rendered through the model's chat template when it has one) is answered greedily
by both models. Then B reads A's answer (teacher forcing), so the two next-token distributions
can be compared at every answer position: mean KL divergence KL(A || B) and how often both rank
the same token first. The first token where the two greedy answers differ says where they part.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from quantize.errors import QuantizeError
from quantize.report import _log_softmax


@dataclass
class PromptResult:
    prompt: str
    answer_a: str
    answer_b: str
    diverges_at: int | None  # index of the first answer token that differs; None if identical
    mean_kld: float
    top1_agreement: float
    n_tokens: int


def read_prompts(path: str | os.PathLike) -> list[str]:
    """One prompt per line; blank lines are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantizeError(f"cannot read prompts from {path}: {exc}") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise QuantizeError(f"{path} holds no prompts (one per line)")
    return prompts


def _render(model, prompt: str) -> list[int]:
    template = model.chat_template()
    if template is None:
        return model.tokenize(prompt, add_special=True)
    lc = model._lc
    messages = (lc.llama_chat_message * 1)()
    messages[0].role, messages[0].content = b"user", prompt.encode()
    size = 4 * len(prompt.encode()) + 4096
    buf = ctypes.create_string_buffer(size)
    n = lc.llama_chat_apply_template(template.encode(), messages, 1, True, buf, size)
    if n < 0 or n > size:
        return model.tokenize(prompt, add_special=True)
    return model.tokenize(buf.raw[:n].decode("utf-8", "replace"), add_special=True, parse_special=True)


def _greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
    """The greedy answer and the logits that chose each of its tokens."""
    eos = {model._lc.llama_vocab_eos(model.vocab), model._lc.llama_vocab_eot(model.vocab)}
    model.reset()
    logits = model.feed(prompt, 0)
    answer, rows = [], []
    while len(answer) < max_tokens and len(prompt) + len(answer) < model.n_ctx:
        token = int(logits.argmax())
        rows.append(logits)
        if token in eos:
            break
        answer.append(token)
        logits = model.feed([token], len(prompt) + len(answer) - 1)
    return answer, np.array(rows, dtype=np.float32).reshape(len(rows), model.n_vocab)


def _forced(model, prompt: list[int], answer: list[int], n_rows: int) -> np.ndarray:
    """B's logits at each position of A's answer (the position before each answer token)."""
    tokens = prompt + answer
    rows = []
    for start, n in model.decode(tokens):
        ptr = model._lc.llama_get_logits(model.ctx)
        batch = np.ctypeslib.as_array(ptr, shape=(n, model.n_vocab))
        lo, hi = max(len(prompt) - 1, start), min(len(prompt) - 1 + n_rows, start + n)
        if lo < hi:
            rows.append(batch[lo - start : hi - start].copy())
    return np.concatenate(rows)


def compare_prompts(a: str | os.PathLike, b: str | os.PathLike, prompts: list[str], *, max_tokens: int = 64,
                    n_ctx: int = 1024, threads: int | None = None) -> list[PromptResult]:
    from quantize.llm import Model

    for path in (a, b):
        if not Path(path).is_file():
            raise QuantizeError(f"{path} does not exist")
    results = []
    with Model(a, n_ctx=n_ctx, threads=threads) as ma, Model(b, n_ctx=n_ctx, threads=threads) as mb:
        if ma.n_vocab != mb.n_vocab:
            raise QuantizeError("the two models have different vocabularies; compare two files of one model")
        for prompt in prompts:
            tokens = _render(ma, prompt)
            if len(tokens) >= n_ctx - 1:
                raise QuantizeError(f"a prompt of {len(tokens)} tokens does not fit the comparison's context ({n_ctx})")
            answer_a, logits_a = _greedy(ma, tokens, max_tokens)
            answer_b, _ = _greedy(mb, tokens, max_tokens)
            logits_b = _forced(mb, tokens, answer_a, len(logits_a))
            pa, pb = _log_softmax(logits_a), _log_softmax(logits_b)
            kld = (np.exp(pa) * (pa - pb)).sum(axis=-1)
            top1 = logits_a.argmax(-1) == logits_b.argmax(-1)
            diverges = next((i for i, (x, y) in enumerate(zip(answer_a, answer_b, strict=False)) if x != y), None)
            if diverges is None and len(answer_a) != len(answer_b):
                diverges = min(len(answer_a), len(answer_b))
            results.append(PromptResult(
                prompt, _text(ma, answer_a), _text(mb, answer_b), diverges,
                float(kld.mean()), float(top1.mean()), len(logits_a),
            ))
    return results


def _text(model, tokens: list[int]) -> str:
    return b"".join(model.piece(t) for t in tokens).decode("utf-8", "replace")


def as_json(a, b, results: list[PromptResult]) -> dict:
    return {"a": str(a), "b": str(b), "prompts": [asdict(r) for r in results], "summary": summary(results)}


def summary(results: list[PromptResult]) -> dict:
    n = sum(r.n_tokens for r in results)
    return {
        "prompts": len(results),
        "identical_answers": sum(r.diverges_at is None for r in results),
        "mean_kld": sum(r.mean_kld * r.n_tokens for r in results) / n if n else 0.0,
        "top1_agreement": sum(r.top1_agreement * r.n_tokens for r in results) / n if n else 1.0,
    }
