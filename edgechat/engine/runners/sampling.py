"""SamplingParams -> llama.cpp's native sampler chain, so no per-token sampling runs in Python."""

from __future__ import annotations

import ctypes
import random

import llama_cpp as L
import numpy as np

from edgechat.params import Grammar, SamplingParams


def uses_penalties(params: SamplingParams) -> bool:
    return params.repeat_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


class SamplerChain:
    """An owned llama_sampler chain; free() must run on the engine thread when the request ends."""

    def __init__(self, params: SamplingParams, n_vocab: int, vocab=None, grammar: Grammar | None = None):
        self.seed = params.seed if params.seed is not None else random.randrange(1 << 31)
        # made first: a grammar llama.cpp refuses must not leave a half-built chain behind
        constrain = _grammar_sampler(vocab, grammar) if grammar is not None else None
        cparams = L.llama_sampler_chain_default_params()
        cparams.no_perf = True
        chain = L.llama_sampler_chain_init(cparams)
        add = lambda smpl: L.llama_sampler_chain_add(chain, smpl)  # noqa: E731
        if params.logit_bias:
            # first, as llama.cpp's own chains place it: every later sampler sees the biased logits
            biases = (L.llama_logit_bias * len(params.logit_bias))(*(L.llama_logit_bias(t, b) for t, b in params.logit_bias))
            add(L.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        self._penalties = None
        if uses_penalties(params):
            self._penalties = L.llama_sampler_init_penalties(
                n_vocab,
                params.penalty_last_n,
                params.repeat_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            )
            add(self._penalties)
        if constrain is not None:
            # before any truncation: top-k of the raw distribution may hold no allowed token
            add(constrain)
        self._grammar = constrain  # owned by the chain
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
        # biased or penalised logits are not the model's: their argmax needs the chain
        raw = params.temperature == 0 and not self.penalised and not params.logit_bias
        #: plain greedy needs no chain at all: the engine takes the argmax of the logits
        self.plain_greedy = raw and grammar is None
        #: greedy under a grammar: the top token is tried against the grammar first
        self.grammar_greedy = raw and grammar is not None
        self.penalty_last_n = params.penalty_last_n
        # choose()'s llama_token_data array and the token ids it starts from, made on first use
        self._candidates: np.ndarray | None = None
        self._ids: np.ndarray | None = None

    def accept_prompt(self, tokens: list[int]) -> None:
        """Penalties count the recent prompt tokens too, as llama.cpp's own tools do (only the
        penalties: a grammar must see the answer alone)."""
        if self._penalties is not None:
            for tok in tokens[-self.penalty_last_n :]:
                L.llama_sampler_accept(self._penalties, tok)

    def allowed_argmax(self, logits: np.ndarray) -> int | None:
        """Greedy under a grammar: when the model's top token is one the grammar allows, it is the
        grammar's greedy choice too, found without running the grammar over the whole vocabulary
        (llama.cpp's own tools check the sampled token first the same way; structured output ran
        at 0.48x plain decoding on SmolLM2). The token is accepted, as the chain would; None when
        the grammar refuses it, and the whole chain must choose."""
        token = int(logits.argmax())
        cand = L.llama_token_data(token, float(logits[token]), 0.0)
        arr = L.llama_token_data_array(ctypes.pointer(cand), 1, -1, False)
        L.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        if cand.logit == -np.inf:
            return None
        L.llama_sampler_accept(self.chain, token)
        return token

    def choose(self, logits: np.ndarray) -> int:
        """The next token from logits held in Python (kept from an earlier decode, or the ONNX
        engine's), chosen and accepted as llama_sampler_sample does with a context's own."""
        if self.plain_greedy:
            return int(logits.argmax())
        if self.grammar_greedy and (token := self.allowed_argmax(logits)) is not None:
            return token
        if self._candidates is None or len(self._candidates) != len(logits):
            self._candidates = np.zeros(len(logits), dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
            self._ids = np.arange(len(logits), dtype=np.int32)
        cand = self._candidates
        cand["id"] = self._ids  # every call: the samplers reorder the array in place
        cand["logit"] = logits
        cand["p"] = 0.0
        arr = L.llama_token_data_array(cand.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), len(cand), -1, False)
        L.llama_sampler_apply(self.chain, ctypes.byref(arr))
        token = int(arr.data[arr.selected].id)
        L.llama_sampler_accept(self.chain, token)
        return token

    def free(self) -> None:
        if self.chain is not None:
            L.llama_sampler_free(self.chain)
            self.chain = None


def grammar_parses(vocab, grammar: Grammar) -> bool:
    """Whether llama.cpp takes this grammar: a client's own GBNF is checked before its request
    is queued (llama.cpp's parser is the only judge of what it accepts)."""
    try:
        smpl = _grammar_sampler(vocab, grammar)
    except ValueError:
        return False
    L.llama_sampler_free(smpl)
    return True


def _grammar_sampler(vocab, grammar: Grammar):
    gbnf, root = grammar.gbnf.encode(), grammar.root.encode()
    if grammar.triggers:
        patterns = (ctypes.c_char_p * len(grammar.triggers))(*(p.encode() for p in grammar.triggers))
        smpl = L.llama_sampler_init_grammar_lazy_patterns(vocab, gbnf, root, patterns, len(grammar.triggers), None, 0)
    else:
        smpl = L.llama_sampler_init_grammar(vocab, gbnf, root)
    if not smpl:
        # the grammars come from our own converter: one llama.cpp refuses is our bug
        raise ValueError("llama.cpp could not parse the grammar")
    return smpl
