"""SamplingParams -> llama.cpp's native sampler chain, so no per-token sampling runs in Python."""

from __future__ import annotations

import random

import llama_cpp as L

from edgechat.engine.request import SamplingParams
from edgechat.errors import UsageError


def validate(params: SamplingParams) -> None:
    """One-line errors for values llama.cpp would accept silently or crash on."""
    if params.temperature < 0:
        raise UsageError(f"temperature must be >= 0 (got {params.temperature}); use 0 for greedy")
    if not 0 <= params.top_p <= 1:
        raise UsageError(f"top_p must be between 0 and 1 (got {params.top_p})")
    if not 0 <= params.min_p <= 1:
        raise UsageError(f"min_p must be between 0 and 1 (got {params.min_p})")
    if params.top_k < 0:
        raise UsageError(f"top_k must be >= 0 (got {params.top_k}); 0 disables it")
    if params.repeat_penalty <= 0:
        raise UsageError(f"repeat_penalty must be > 0 (got {params.repeat_penalty}); 1 disables it")


def uses_penalties(params: SamplingParams) -> bool:
    return params.repeat_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


class SamplerChain:
    """An owned llama_sampler chain; free() must run on the engine thread when the request ends."""

    def __init__(self, params: SamplingParams, n_vocab: int):
        self.seed = params.seed if params.seed is not None else random.randrange(1 << 31)
        cparams = L.llama_sampler_chain_default_params()
        cparams.no_perf = True
        chain = L.llama_sampler_chain_init(cparams)
        add = lambda smpl: L.llama_sampler_chain_add(chain, smpl)  # noqa: E731
        if uses_penalties(params):
            add(
                L.llama_sampler_init_penalties(
                    n_vocab,
                    params.penalty_last_n,
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                )
            )
        if params.temperature == 0:
            add(L.llama_sampler_init_greedy())
        else:
            # the order llama.cpp's own samplers use: truncate the distribution, then temperature
            if params.top_k > 0:
                add(L.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                add(L.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                add(L.llama_sampler_init_min_p(params.min_p, 1))
            add(L.llama_sampler_init_temp(params.temperature))
            add(L.llama_sampler_init_dist(self.seed))
        self.chain = chain
        self.penalised = uses_penalties(params)
        #: plain greedy needs no chain at all: the engine takes the argmax of the logits
        self.plain_greedy = params.temperature == 0 and not self.penalised
        self.penalty_last_n = params.penalty_last_n

    def accept_prompt(self, tokens: list[int]) -> None:
        """Penalties count the recent prompt tokens too, as llama.cpp's own tools do."""
        if self.penalised:
            for tok in tokens[-self.penalty_last_n :]:
                L.llama_sampler_accept(self.chain, tok)

    def free(self) -> None:
        if self.chain is not None:
            L.llama_sampler_free(self.chain)
            self.chain = None
