"""Held-out evaluation: when it runs, what it scores, the greedy baseline."""

from __future__ import annotations

import pytest

from rayspec.batch import RolloutBatch
from rayspec.data import Problem
from rayspec.reward.builtins import last_number
from rayspec.rollout.spec_stats import SpecStats
from rayspec.train.evaluate import BASELINE_FILE, eval_due, read_baseline, score_eval, write_baseline

PROBLEMS = [Problem("What is 2 + 3?", {"answer": "5"}, "arithmetic", 0),
            Problem("What is 9 - 4?", {"answer": "5"}, "arithmetic", 1)]


def _batch(texts: list[str], ids: list[list[int]], n: int, version: int = 3) -> RolloutBatch:
    return RolloutBatch([[1]] * len(texts), ids, [[0.0] * len(r) for r in ids],
                        [i // n for i in range(len(texts))], policy_version=version, texts=texts)


def test_eval_due_at_the_start_every_n_steps_and_at_the_last():
    assert [v for v in range(0, 13) if eval_due(v, every=5, last=12)] == [0, 5, 10, 12]
    assert not any(eval_due(v, every=0, last=12) for v in range(13))


def test_score_eval_rewards_lengths_and_changed_greedy_answers():
    greedy = _batch(["2 + 3 = 5", "9 - 4 = 6"], [[7, 8, 9], [7, 8]], n=1)
    sampled = _batch(["5", "The answer is 5.", "4", "five"], [[5], [1, 2, 3, 4, 5], [4], [6, 6]], n=2)
    stats = SpecStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6)
    rewards = {"reward_greedy": last_number(None, greedy.texts, None, ["5", "5"]),
               "reward_sampled": last_number(None, sampled.texts, None, ["5"] * 4)}
    rec = score_eval(PROBLEMS, greedy, sampled, stats, baseline=[[7, 8, 9], [7, 8, 1]], **rewards)
    assert rec["policy_version"] == 3
    assert rec["reward_greedy"] == 0.5  # the second greedy answer is 6
    assert rec["reward_sampled"] == 0.5  # "5" and "The answer is 5." right; "4" and "five" wrong
    assert rec["response_len_greedy"] == 2.5 and rec["response_len_sampled"] == 2.25
    assert rec["acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert rec["greedy_changed"] == 0.5  # the second response differs from the baseline's
    assert "greedy_changed" not in score_eval(PROBLEMS, greedy, sampled, stats, baseline=None, **rewards)
    with pytest.raises(ValueError, match=f"{BASELINE_FILE} holds 3 greedy responses.*2 problems"):
        score_eval(PROBLEMS, greedy, sampled, stats, baseline=[[1], [2], [3]], **rewards)


def test_baseline_round_trips_and_is_ignored_for_other_problems(tmp_path):
    assert read_baseline(tmp_path, PROBLEMS) is None
    write_baseline(tmp_path, PROBLEMS, _batch(["a", "b"], [[1, 2], [3]], n=1))
    assert read_baseline(tmp_path, PROBLEMS) == [[1, 2], [3]]
    assert read_baseline(tmp_path, PROBLEMS[::-1]) is None  # another held-out set
    assert [p.name for p in tmp_path.iterdir()] == [BASELINE_FILE]  # no temp file left behind
