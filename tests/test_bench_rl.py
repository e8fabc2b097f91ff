"""jobs.bench_rl: the three runs differ only in speculation and draft
training, and the table/JSON/plot come from their metrics."""

from __future__ import annotations

import json

import pytest

from jobs.bench_rl import format_table, main, plot, runs, summarize
from jobs.cli import DEFAULT_PRESET
from rayspec.config import load_config


def _records(acc: list[float]) -> list[dict]:
    recs = [{"acceptance_length": a, "rollout_tokens_per_s": 10.0 * a, "reward_mean": 0.1 * i,
             "kl": 0.01 * i, "time_step_s": 50.0, "time_rollout_s": 20.0} for i, a in enumerate(acc)]
    ev = {"reward_greedy": 0.5, "reward_sampled": 0.25, "acceptance_length": 1.5, "greedy_changed": 0.0}
    recs[0]["evals"] = [{"policy_version": 0, **ev}]
    recs[-1]["evals"] = [{"policy_version": len(acc), **ev}]
    return recs


def test_runs_differ_only_in_speculation_and_draft_training(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    cfgs = {n: load_config(DEFAULT_PRESET, o) for n, o in runs(str(head)).items()}
    assert cfgs["none"].rollout.speculative_config.method is None
    for n in ("frozen", "online", "adaptive", "online-adaptive"):
        assert cfgs[n].rollout.speculative_config.model == str(head)
    assert not cfgs["frozen"].draft.enabled and cfgs["online"].draft.enabled
    assert cfgs["adaptive"].rollout.adaptive_k.enabled and not cfgs["frozen"].rollout.adaptive_k.enabled
    assert not cfgs["adaptive"].draft.enabled
    assert cfgs["online-adaptive"].draft.enabled and cfgs["online-adaptive"].rollout.adaptive_k.enabled
    assert runs(None)["online-adaptive"][1] == "rollout.speculative_config.model=null"
    sfx, group = cfgs["suffix"].rollout.speculative_config, cfgs["suffix-group"].rollout.speculative_config
    assert sfx.method == group.method == "suffix" and sfx.num_speculative_tokens == 8
    # suffix: the sequence's own prompt and response; suffix-group: vLLM's window of other responses too
    assert sfx.suffix_decoding_max_cached_requests == 0 and group.suffix_decoding_max_cached_requests is None
    assert not cfgs["suffix"].draft.enabled and group.model is None
    assert not cfgs["suffix-group"].rollout.adaptive_k.enabled and cfgs["suffix-group-adaptive"].rollout.adaptive_k.enabled
    assert vars(cfgs["suffix-group-adaptive"].rollout.speculative_config) == vars(group)
    assert len({(c.data.name, c.data.seed, c.trainer.seed, c.grpo.max_new_tokens) for c in cfgs.values()}) == 1


def test_table_and_plot(tmp_path):
    rows = [summarize("frozen", _records([2.0, 1.8, 1.5])),
            summarize("online", _records([2.0, 2.1, 2.2]))]
    assert rows[0]["acceptance_length_median"] == 1.8 and rows[0]["steps_seconds_total"] == 150.0
    assert rows[0]["kl"] == [0.0, 0.01, 0.02] and rows[0]["eval"]["policy_version"] == [0, 3]
    assert len(rows[0]["draft_trained"]) == 3  # NaN where a run's steps lack the key (no draft)
    table = format_table(rows)
    # header, 3 steps, medians, a held-out line per run, logprob agreement
    assert "frozen" in table and table.count("\n") == 7
    assert "online held-out" in table and "3: 0.500/0.250/1.50" in table
    assert rows[0]["estimate_pairs"] == [] and "estimated by the DraftTrainer" not in table
    assert plot(rows, tmp_path / "rl.png").read_bytes()[:4] == b"\x89PNG"


def test_estimates_are_paired_with_the_same_rollouts_measurement():
    recs = _records([1.5, 1.6, 1.7, 1.8])
    for i, r in enumerate(recs):
        r.update(step=i + 1, num_drafts=10, acceptance_rate_per_pos=[0.5 + 0.1 * i, 0.2],
                 draft_acceptance_estimate=[0.6 + 0.1 * i, 0.3, 0.1])
    recs[2]["num_drafts"] = 0  # adaptive k drafted nothing at step 3: nothing measured
    row = summarize("online", recs)
    assert [p["step"] for p in row["estimate_pairs"]] == [1, 2, 4]
    assert row["estimate_pairs"][1] == {"step": 2, "estimated": [0.7, 0.3], "measured": [0.6, 0.2]}
    assert row["acceptance_estimated_mean"] == pytest.approx([(0.6 + 0.7 + 0.9) / 3, 0.3])
    assert row["acceptance_measured_mean"] == pytest.approx([(0.5 + 0.6 + 0.8) / 3, 0.2])
    assert "(mean over 3 steps): [0.733, 0.300] / [0.633, 0.200]" in format_table([row])
    assert "acceptance_where_drafted_mean" not in row


def test_estimate_where_the_schedule_drafted_weighs_the_replay_by_share_by_the_drafted_tokens():
    """One replica drafted at 1-2 sequences of 8: the replay by share pairs
    the tail's bucket, weighted as the controller weighs it, with the
    measurement."""
    recs = _records([1.5])
    # 8 sequences: 6 of 4 tokens, 2 of 20 (16 positions at b = 2: the bucket of share 1/4)
    recs[0].update(step=1, num_drafts=10, acceptance_rate_per_pos=[0.2, 0.05], response_lens=[4] * 6 + [20] * 2,
                   draft_acceptance_estimate=[0.6, 0.3],
                   draft_acceptance_by_share=[[1.0, 40, [0.8, 0.5]], [0.25, 20, [0.15, 0.0]]],
                   replicas={"r0": {"k_schedule": [[1, 2, 2], [3, 8, 0]]}})
    row = summarize("online", recs)
    assert row["estimate_pairs"][0]["estimated_where_drafted"] == pytest.approx([0.15, 0.0])
    assert row["acceptance_where_drafted_mean"] == [pytest.approx([0.15, 0.0]), pytest.approx([0.2, 0.05])]
    assert "replayed where the schedule drafted / measured (mean over the 1 of them replayed by share): " \
        "[0.150, 0.000] / [0.200, 0.050]" in format_table([row])


def _write_run(run_dir, acc):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(acc)))


def test_refuses_unknown_run_and_unfinished_run(tmp_path, capsys):
    base = ["--warm-head", str(tmp_path), "--steps", "3", "--run-dir", str(tmp_path / "r")]
    assert main(base + ["--runs", "none,fast"]) == 2
    assert "unknown ['fast']" in capsys.readouterr().err
    _write_run(tmp_path / "r" / "frozen", [1.5, 1.4])
    before = (tmp_path / "r" / "frozen" / "metrics.jsonl").read_text()
    assert main(base + ["--runs", "frozen"]) == 2
    assert "unfinished run (2 of 3 steps)" in capsys.readouterr().err
    assert (tmp_path / "r" / "frozen" / "metrics.jsonl").read_text() == before


def test_finished_runs_are_read_back_not_rerun(tmp_path):
    for name, acc in (("frozen", [1.5, 1.4, 1.3]), ("online", [1.5, 1.6, 1.7, 1.8])):
        _write_run(tmp_path / "r" / name, acc)
    out = tmp_path / "rl.json"
    assert main(["--warm-head", str(tmp_path), "--steps", "3", "--runs", "frozen,online",
                 "--run-dir", str(tmp_path / "r"), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["run"] for r in rows] == ["frozen", "online"]
    assert rows[1]["acceptance_length"] == [1.5, 1.6, 1.7]
    assert (tmp_path / "r" / "rl.png").exists()


def test_none_seeds_add_spread_runs_and_equivalence_verdict(tmp_path, capsys):
    """--none-seeds adds none@<seed> runs differing only in trainer.seed;
    compare_to_none sets each speculative run's mean reward distance to all
    none seeds against the most atypical none seed's distance to the others."""
    from jobs.bench_rl import compare_to_none

    def row(name, rewards):
        recs = _records([1.0] * len(rewards))
        for r, x in zip(recs, rewards):
            r["reward_mean"], r["token_mult_prob_error"] = x, 1e-3
        return summarize(name, recs)

    rows = [row("none", [0.1, 0.2, 0.3]), row("online", [0.1, 0.25, 0.3]),
            row("frozen", [0.5, 0.6, 0.7]), row("none@1", [0.2, 0.2, 0.2]),
            row("none@2", [0.2, 0.2, 0.5])]
    compare_to_none(rows)
    assert rows[0]["seed_distances"] == pytest.approx(
        {"none~none@1": 0.2 / 3, "none~none@2": 0.1, "none@1~none@2": 0.1})
    assert rows[0]["seed_spread"] == pytest.approx(0.1)  # none@2: (0.1 + 0.1) / 2
    assert rows[1]["reward_dist_to_none"] == pytest.approx(
        {"none": 0.05 / 3, "none@1": 0.25 / 3, "none@2": 0.35 / 3})
    assert rows[1]["within_seed_spread"] and not rows[2]["within_seed_spread"]
    assert rows[2]["reward_dist_to_none_mean"] == pytest.approx(1.1 / 3)
    assert "within_seed_spread" not in rows[3] and "within_seed_spread" not in rows[4]
    table = format_table(rows)
    assert "OUTSIDE the spread" in table and "logprob agreement" in table
    assert main(["--none-seeds", "1,x", "--runs", "none"]) == 2
    assert "--none-seeds=1,x" in capsys.readouterr().err
    assert main(["--runs", "frozen"]) == 2
    assert "need --warm-head" in capsys.readouterr().err
    fresh = runs(None)
    assert "rollout.speculative_config.model=null" in fresh["online"] and "frozen" not in fresh


@pytest.mark.parametrize("keep", [False, True])
def test_finished_run_checkpoints_are_deleted_unless_kept(tmp_path, monkeypatch, keep):
    """A run the bench finished leaves its metrics and drops its checkpoints
    (gigabytes each) unless ``--keep-checkpoints``."""
    import rayspec.driver as driver

    def fake_run(cfg, resume=False):  # a finished run as the driver leaves it
        run_dir = tmp_path / "r" / "none"
        _write_run(run_dir, [1.0, 1.0])
        (run_dir / "ray_train" / "train" / "checkpoint_000001").mkdir(parents=True)
        (run_dir / "draft_head").mkdir()

    monkeypatch.setattr(driver, "run", fake_run)
    monkeypatch.setattr(driver, "init_ray", lambda cfg: None)
    assert main(["--steps", "2", "--runs", "none", "--run-dir", str(tmp_path / "r"),
                 "--out", str(tmp_path / "rl.json")]
                + (["--keep-checkpoints"] if keep else [])) == 0
    assert json.loads((tmp_path / "rl.json").read_text())[0]["steps"] == 2
    assert (tmp_path / "r" / "none" / "ray_train").exists() == keep
    assert (tmp_path / "r" / "none" / "draft_head").exists()
