"""Held-out evaluation: how well the policy the rollout replicas hold solves
problems training never sees, and how far its greedy answers have moved.

Every ``trainer.eval_every`` steps (and before the first, and after the
last) rank 0 sends the held-out prompts (``data.eval_num_problems``, see
``rayspec.data.heldout_split``) through the same Serve handle as the
rollouts: once greedy, once with ``trainer.eval_samples`` samples per
problem at the RL temperature. The sampled pass draws with the same seed at
every evaluation (common random numbers), so two evaluations differ by the
policy, not by the sampler's luck.
"""

from __future__ import annotations

import json
import os
from statistics import fmean as mean
from pathlib import Path
from typing import Any, Optional

from rayspec.batch import RolloutBatch
from rayspec.data import Problem
from rayspec.files import write_text_atomic
from rayspec.rollout.spec_stats import SpecStats

BASELINE_FILE = "eval_baseline.json"


def eval_due(version: int, every: int, last: int) -> bool:
    """Whether policy version ``version`` (= RL steps trained) is evaluated:
    the initial policy, every ``every`` steps, and the last (``last``)."""
    return every > 0 and (version % every == 0 or version == last)


def score_eval(problems: list[Problem], greedy: RolloutBatch, sampled: RolloutBatch, stats: SpecStats,
               baseline: Optional[list[list[int]]], reward_greedy: list[float],
               reward_sampled: list[float]) -> dict[str, Any]:
    """One evaluation's record.

    Args:
        problems: the held-out problems, in prompt order.
        greedy: one greedy response per problem (``group`` = problem index).
        sampled: ``n`` responses per problem at the RL temperature.
        stats: the sampled pass's speculative-decoding counters (fixed
            prompts and seed: the draft's acceptance on a fixed workload).
        baseline: the initial policy's greedy response token ids per
            problem, or None where the run has none.
        reward_greedy / reward_sampled: each response's reward (``reward.functions``' weighted sum).

    Returns:
        {"policy_version", "reward_greedy", "reward_sampled" (mean reward), "response_len_greedy", "response_len_sampled" (mean tokens),
        "acceptance_length" (tokens per verification step of the sampled
        pass), "num_drafts" (its verification steps that carried a draft:
        0 where adaptive k drafted nothing), and "greedy_changed" (fraction of problems whose greedy
        response differs from the baseline's; absent without a baseline)}.

    Raises:
        ValueError: a baseline for a different number of problems.
    """
    out = {"policy_version": greedy.policy_version,
           "reward_greedy": mean(reward_greedy),
           "reward_sampled": mean(reward_sampled),
           "response_len_greedy": mean([len(r) for r in greedy.response_ids]),
           "response_len_sampled": mean([len(r) for r in sampled.response_ids]),
           "acceptance_length": stats.acceptance_length, "num_drafts": stats.num_drafts}
    if baseline is not None:
        if len(baseline) != len(greedy.response_ids):
            raise ValueError(f"{BASELINE_FILE} holds {len(baseline)} greedy responses, the held-out set "
                             f"has {len(greedy.response_ids)} problems")
        out["greedy_changed"] = mean([list(r) != list(b) for r, b in zip(greedy.response_ids, baseline)])
    return out


def read_baseline(run_dir: str | os.PathLike, problems: list[Problem]) -> Optional[list[list[int]]]:
    """The initial policy's greedy responses saved by :func:`write_baseline`,
    or None if the run has none or they are of other problems (a resumed run
    whose held-out set changed)."""
    path = Path(run_dir) / BASELINE_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("prompts") != [p.key for p in problems]:
        return None
    return saved["response_ids"]


def write_baseline(run_dir: str | os.PathLike, problems: list[Problem], greedy: RolloutBatch) -> None:
    """Keep the initial policy's greedy responses (``<run_dir>/eval_baseline.json``,
    written whole through a rename) for ``greedy_changed`` after a resume."""
    write_text_atomic(Path(run_dir) / BASELINE_FILE, json.dumps(
        {"prompts": [p.key for p in problems], "response_ids": greedy.response_ids}))
