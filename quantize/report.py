"""The quality report: what quantization cost, measured against the F16 conversion.

Both models read the same built-in text (English, Chinese and code) at context 512, batch by
batch in lockstep, so only one batch of logits per model is in memory even with a 262k vocabulary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantize.errors import QuantizeError

SAMPLE_TEXT = """\
The lighthouse keeper wrote in his log every evening, even when nothing had happened. On calm nights he
noted the wind, the colour of the sea and the ships that passed far out on the horizon. When storms came
he wrote less, because he was busy keeping the lamp burning, but he never skipped a day. Years later his
granddaughter found the notebooks in a wooden chest and read them one winter, slowly, as if the old man
were still telling her about the weather.

城市的早晨总是从一杯热豆浆开始。街角的小店六点就开门了，老板一边炸油条，一边和熟客聊天。
上班的人匆匆买好早餐，骑上自行车消失在路口。学生们背着书包，三五成群地走向学校。
等到太阳升高，街道渐渐安静下来，只剩下几位老人坐在树下下棋，慢慢地度过一天。

def moving_average(values, window):
    \"\"\"Return the averages of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    result = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        result.append(total / window)
    return result

print(moving_average([3, 1, 4, 1, 5, 9, 2, 6], 3))
"""

# Mean KL divergence above which the report warns, per type: well above what llama.cpp's
# mixtures usually cost on small models, so a warning means something went wrong or the model
# is unusually sensitive.
WARN_KLD = {"Q8_0": 0.01, "Q6_K": 0.04, "Q5_K_M": 0.08, "Q4_K_M": 0.2, "Q4_K_S": 0.25, "Q4_0": 0.4}

N_CTX = 512


@dataclass
class Quality:
    n_tokens: int
    ppl_reference: float
    ppl_quantized: float
    mean_kld: float
    top1_agreement: float

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_quantized / self.ppl_reference

    def table(self) -> str:
        rows = [
            ("tokens evaluated", f"{self.n_tokens}"),
            ("perplexity, F16", f"{self.ppl_reference:.3f}"),
            ("perplexity, quantized", f"{self.ppl_quantized:.3f}"),
            ("perplexity ratio", f"{self.ppl_ratio:.4f}"),
            ("mean KL divergence", f"{self.mean_kld:.5f}"),
            ("top-1 agreement", f"{100 * self.top1_agreement:.1f}%"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    @staticmethod
    def pooled(parts: list[Quality]) -> Quality:
        """The figures over all tokens of several separately evaluated chunks."""
        n = sum(q.n_tokens for q in parts)

        def mean(values) -> float:
            return sum(v * q.n_tokens for v, q in zip(values, parts, strict=True)) / n

        return Quality(n, float(np.exp(mean(np.log([q.ppl_reference for q in parts])))),
                       float(np.exp(mean(np.log([q.ppl_quantized for q in parts])))),
                       mean([q.mean_kld for q in parts]), mean([q.top1_agreement for q in parts]))

    def warning(self, type_name: str | None) -> str | None:
        limit = WARN_KLD.get((type_name or "").upper())
        if limit is not None and self.mean_kld > limit:
            return (
                f"quality loss is large for {type_name} (mean KLD {self.mean_kld:.3f} > {limit}); "
                "try a larger type such as Q5_K_M or Q6_K"
            )
        return None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(quantized: str | os.PathLike, reference: str | os.PathLike, text: str = SAMPLE_TEXT,
            threads: int | None = None, max_chunks: int = 1) -> Quality:
    """Perplexity of both models on `text`, the mean KL divergence from the reference, top-1 agreement;
    over up to `max_chunks` consecutive chunks of N_CTX tokens, each from an empty cache with BOS first."""
    from quantize.llm import Model

    for path in (quantized, reference):
        if not Path(path).is_file():
            raise QuantizeError(f"{path} does not exist")
    with Model(reference, n_ctx=N_CTX, threads=threads) as ref, Model(quantized, n_ctx=N_CTX, threads=threads) as quant:
        if ref.n_vocab != quant.n_vocab:
            raise QuantizeError("the two models have different vocabularies; compare a model with its own F16")
        tokens = ref.tokenize(text, add_special=True)
        parts = []
        for start in range(0, min(len(tokens), max_chunks * N_CTX), N_CTX):
            chunk = tokens[start : start + N_CTX]
            if len(chunk) < 2:
                break
            if ref.bos is not None:
                chunk[0] = ref.bos
            parts.append(compare_logits(ref.logits(chunk), quant.logits(chunk), chunk))
        return Quality.pooled(parts)


def compare_logits(reference, quantized, tokens: list[int]) -> Quality:
    """The report's figures from two models' logits over `tokens`, given as lockstep iterators
    of (start, logits) batches (logits[i] predicts tokens[start + i + 1])."""
    nll_ref = nll_q = kld = 0.0
    agree = n = 0
    for (start, lr), (_, lq) in zip(reference, quantized, strict=True):
        targets = np.array(tokens[start + 1 : start + 1 + len(lr)])
        m = len(targets)  # the last position has nothing to predict
        pr, pq = _log_softmax(lr[:m]), _log_softmax(lq[:m])
        idx = np.arange(m)
        nll_ref -= pr[idx, targets].sum()
        nll_q -= pq[idx, targets].sum()
        kld += (np.exp(pr) * (pr - pq)).sum()
        agree += int((lr[:m].argmax(-1) == lq[:m].argmax(-1)).sum())
        n += m
    return Quality(n, float(np.exp(nll_ref / n)), float(np.exp(nll_q / n)), float(kld / n), agree / n)
