"""Reduced draft vocabulary of an EAGLE-3 head, chosen by token frequency.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840) and its published heads keep the
most frequent tokens of the training responses (32k of Llama-3's 128k): the
head's output layer is read once per draft token, so its size is most of the
drafter's cost for a small policy (SmolLM2-135M: 28M of the head's 33M
parameters at the full 49,152 tokens). A token outside the draft vocabulary
is never proposed, so what it costs is the acceptance of those positions,
bounded by the response tokens the vocabulary misses (``coverage``).
"""

from __future__ import annotations

from typing import Iterable

import torch


def token_counts(sequences: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64 occurrences of each token id in ``sequences``.

    Raises:
        ValueError: a token id outside [0, vocab_size).
    """
    flat = [t for seq in sequences for t in seq]
    if not flat:
        return torch.zeros(vocab_size, dtype=torch.long)
    t = torch.tensor(flat, dtype=torch.long)  # one bincount: per sequence it took 25 ms each
    if int(t.min()) < 0 or int(t.max()) >= vocab_size:
        raise ValueError(f"token id outside [0, {vocab_size}) (found {int(t.min())} .. {int(t.max())})")
    return torch.bincount(t, minlength=vocab_size)


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int,
                       always: Iterable[int] = ()) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent token ids, in increasing id order
    (the order ``d2t`` stores). Ties, and the rest once every seen token is
    in, go to the lower id; ``always`` (e.g. end-of-sequence ids, which end
    every response once) are kept whatever their count.

    Args:
        counts: [V] int64 (``token_counts``).

    Returns:
        [draft_vocab_size] int64 token ids.

    Raises:
        ValueError: ``draft_vocab_size`` not in [len(always), V].
    """
    always = sorted(set(always))
    V = counts.numel()
    if not len(always) <= draft_vocab_size <= V:
        raise ValueError(f"draft.draft_vocab_size={draft_vocab_size}: need {len(always)} to {V}")
    score = counts.double()
    score[always] = float("inf")
    # stable descending sort: equal counts keep increasing id order
    order = torch.sort(score, descending=True, stable=True).indices
    return order[:draft_vocab_size].sort().values


def coverage(counts: torch.Tensor, token_ids: torch.Tensor) -> float:
    """Fraction of the counted tokens that are in ``token_ids`` (1.0 for no counts)."""
    total = int(counts.sum())
    return float(counts[token_ids].sum()) / total if total else 1.0
