"""Speculative decoding keeps the sampled distribution (issue 11): at temperature 1 over the
whole vocabulary, a seeded run with n-gram lookup gives the same tokens as the same seed without
it, and over many different seeds the first tokens are distributed alike (a two-sample
chi-square test, its p-value from label permutations so no statistics package is needed)."""

from __future__ import annotations

import numpy as np
import pytest

from edgechat.engine import ChatRequest, SamplingParams

#: the answer starts like the quoted line, so lookup drafts from the second token on (the line
#: follows a newline, as the answer follows the template's newline)
PROMPT = "Repeat this sentence exactly:\nThe lighthouse keeper climbed the stairs every evening at six and polished the great lens."
POSITIONS = 4
#: seeds compared one to one (run one at a time: a wider batch's numerics differ slightly) and
#: seeds per arm of the distribution test
SAME_SEEDS, ARM_SEEDS = 40, 200
#: categories rarer than this over both arms are pooled, so no expected count is tiny
MIN_COUNT = 10
PERMUTATIONS = 2000
ALPHA = 0.01


@pytest.fixture(scope="module")
def smol_config() -> dict:
    return {"n_ctx": 1024, "n_parallel": 4}


def submit(engine, seed, mode, temperature=1.0):
    sampling = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    return engine.submit(ChatRequest(messages=[{"role": "user", "content": PROMPT}], sampling=sampling,
                                     max_tokens=POSITIONS, ignore_eos=True, speculative=mode))


def answers(engine, seeds, mode, **kw):
    """All submitted at once: four decode together, which only speeds the test up."""
    handles = [submit(engine, seed, mode, **kw) for seed in seeds]
    return [h.result() for h in handles]


def chi_square(table: np.ndarray) -> float:
    """Pearson's statistic of a 2 x k contingency table."""
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum())


def same_distribution_p(a: list[list[int]], b: list[list[int]]) -> float:
    """p-value that two samples of token sequences share the distribution of each position:
    the sum over positions of the chi-square statistic, against the same sum with the samples'
    labels shuffled (whole sequences move, so positions keep their joint structure)."""
    seqs = np.array(a + b)
    codes = []
    for pos in seqs.T:
        _, inverse, counts = np.unique(pos, return_inverse=True, return_counts=True)
        common = counts >= MIN_COUNT
        # rare tokens share one category; the common ones keep theirs
        codes.append(np.where(common[inverse], np.cumsum(common)[inverse] - 1, common.sum()))
    labels = np.array([0] * len(a) + [1] * len(b))

    def statistic(lab):
        total = 0.0
        for code in codes:
            k = code.max() + 1
            table = np.stack([np.bincount(code[lab == side], minlength=k) for side in (0, 1)])
            total += chi_square(table[:, table.sum(0) > 0])
        return total

    observed = statistic(labels)
    rng = np.random.default_rng(0)
    higher = sum(statistic(rng.permutation(labels)) >= observed for _ in range(PERMUTATIONS))
    return (higher + 1) / (PERMUTATIONS + 1)


def test_a_seed_gives_the_same_tokens_with_lookup(smol):
    # one at a time, so each verification batch holds a single sequence's draft
    plain = [submit(smol, seed, "off").result() for seed in range(SAME_SEEDS)]
    fast = [submit(smol, seed, "lookup").result() for seed in range(SAME_SEEDS)]
    assert sum(f.metrics.drafted_tokens for f in fast) > SAME_SEEDS // 2
    same = sum(p.token_ids == f.token_ids for p, f in zip(plain, fast, strict=True))
    print(f"{same} of {SAME_SEEDS} seeds give the same tokens")
    # batched numerics can move a sampled token only where the draw falls at a boundary
    assert same >= 0.95 * SAME_SEEDS, [(p.text, f.text) for p, f in zip(plain, fast, strict=True) if p.token_ids != f.token_ids]


@pytest.fixture(scope="module")
def plain_arm(smol):
    return [d.token_ids for d in answers(smol, range(ARM_SEEDS), "off")]


def test_the_first_tokens_are_distributed_alike_with_lookup(smol, plain_arm):
    # other seeds than the plain arm's: two independent samples, not the same draws twice
    fast = answers(smol, range(ARM_SEEDS, 2 * ARM_SEEDS), "lookup")
    drafted = sum(d.metrics.drafted_tokens for d in fast)
    assert drafted > ARM_SEEDS // 2 and sum(d.metrics.accepted_tokens for d in fast) > 0
    p = same_distribution_p(plain_arm, [d.token_ids for d in fast])
    print(f"lookup vs off over {ARM_SEEDS} seeds each: p = {p:.3f}, {drafted} tokens drafted")
    assert p > ALPHA


def test_the_distribution_test_sees_a_small_change(smol, plain_arm):
    # the same check between temperature 1 and 0.8 must fail, or it could not catch a biased sampler
    cooler = answers(smol, range(ARM_SEEDS, 2 * ARM_SEEDS), "off", temperature=0.8)
    p = same_distribution_p(plain_arm, [d.token_ids for d in cooler])
    print(f"temperature 0.8 vs 1 over {ARM_SEEDS} seeds each: p = {p:.4f}")
    assert p <= ALPHA
