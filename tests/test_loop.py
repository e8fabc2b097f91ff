"""The main job end to end on an embedded Ray cluster, async on the split
layout: Serve replicas with vLLM speculative decoding, Ray Train workers with
DeepSpeed ZeRO-2, the DraftTrainer actor, weight sync through the
collective transport (a gloo group of the trainer's rank 0 and both
replicas). (Sync on the colocated layout runs under ``ray job
submit`` in test_job_submit.py, and with the real model in the quickstart
notebook, test_notebooks.py.)"""

from __future__ import annotations

import json
import math

import pytest

from rayspec.config import load_config
from rayspec.scheduler import run
from tests.conftest import IN_PROCESS, STEP_RECORD_KEYS


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tiny_loop_async_split_two_replicas(ray_session, tiny_llama_dir, tmp_path):
    """Async on the split layout: each batch after the first was generated
    while the previous step trained, with the policy one version behind;
    prompts are sharded over two replicas, each reporting its own stats.
    Held-out evaluations score the initial policy, every 2nd and the last,
    each once its weights have landed behind the batch generating ahead
    (through the shared_memory transport, whose files must outlive the
    rollouts the refits queue behind)."""
    run_dir = tmp_path / "async"
    cfg = load_config(None, [f"model.path={tiny_llama_dir}", "model.dtype=float32",
                             "trainer.steps=3", f"trainer.run_dir={run_dir}",
                             "grpo.max_new_tokens=24", "data.prompts_per_step=2",
                             "draft.steps_per_rl_step=2", "rollout.num_replicas=2",
                             "scheduler.layout=split", "scheduler.mode=async", "trainer.eval_every=2",
                             "rollout.weight_sync.transport=shared_memory",
                             "data.eval_num_problems=6", "trainer.eval_samples=2", *IN_PROCESS])
    run(cfg)
    recs = _records(run_dir)
    assert [[e["policy_version"] for e in r.get("evals", [])] for r in recs] == [[0], [2], [3]]
    for e in (e for r in recs for e in r["evals"]):
        assert 0.0 <= e["reward_greedy"] <= 1.0 and 0.0 <= e["reward_sampled"] <= 1.0
        assert e["response_len_greedy"] > 0 and e["acceptance_length"] >= 1.0
    assert recs[0]["evals"][0]["greedy_changed"] == 0.0  # the baseline is version 0's own greedy answers
    assert json.loads((run_dir / "eval_baseline.json").read_text())["prompts"][0]
    assert [r["policy_lag"] for r in recs] == [0, 1, 1]
    assert [r["policy_version"] for r in recs] == [0, 0, 1]
    for r in recs:
        assert STEP_RECORD_KEYS <= r.keys()
        assert (r["layout"], r["mode"]) == ("split", "async")
        assert r["time_step_s"] > 0
        for role in ("rollout", "train", "draft"):
            assert 0 <= r[f"idle_{role}_s"] <= r["time_step_s"]
        assert len(r["replicas"]) == 2
        assert sum(s["output_tokens"] for s in r["replicas"].values()) == r["rollout_tokens"]
        # the DraftTrainer's replayed acceptance (one rate per draft position), which
        # the next rollouts carry to the replicas (generate(draft_acceptance=...))
        est = r["draft_acceptance_estimate"]
        assert len(est) == cfg.rollout.speculative_config.num_speculative_tokens and all(0 <= x <= 1 for x in est)
        # the same by share of the step in flight: halving shares, each with its drafts and rates
        shares = [share for share, _, _ in r["draft_acceptance_by_share"]]
        assert shares, r["draft_acceptance_by_share"]
        assert shares == sorted(shares, reverse=True) and all(s == 2.0 ** round(math.log2(s)) <= 1 for s in shares)
        assert all(n >= 16 and len(rates) == len(est) for _, n, rates in r["draft_acceptance_by_share"])
    # weights went through /dev/shm files (the collective transport's Serve path: test_faults),
    # landing behind the rollouts in flight: step 1's refits land in step 2's wait for its batch
    assert [r["weight_sync_transport"] for r in recs] == ["shared_memory"] * 3
    assert recs[0]["weight_sync_bytes"] == 0 and recs[1]["weight_sync_bytes"] > 0
    # the trainer waited less for the 2nd and 3rd batches than they took to generate
    assert recs[2]["time_rollout_s"] < recs[2]["rollout_generation_s"] + recs[2]["time_policy_s"]
