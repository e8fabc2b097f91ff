"""jobs.bench_pipeline's figures from metrics.jsonl records (no Ray)."""

from __future__ import annotations

import pytest

from jobs.bench_pipeline import format_table, main, summarize


def _rec(step, t_step, t_rollout, lag, idle_draft=True):
    r = {"step": step, "time_step_s": t_step, "time_rollout_s": t_rollout,
         "rollout_generation_s": 30.0, "time_policy_s": 40.0, "policy_lag": lag,
         "rollout_tokens_per_s": 20.0, "acceptance_length": 1.1, "reward_mean": 0.25,
         "idle_rollout_s": 10.0, "idle_train_s": 5.0 * step}
    if idle_draft:
        r["idle_draft_s"] = 1.0
    return r


def test_summary_takes_medians_over_steps():
    s = summarize("split", "async", [_rec(1, 100.0, 30.0, 0), _rec(2, 60.0, 2.0, 1),
                                     _rec(3, 70.0, 3.0, 1)], wall_s=300.0)
    assert (s["layout"], s["mode"], s["steps"]) == ("split", "async", 3)
    assert s["step_seconds_median"] == 70.0
    assert s["exposed_rollout_seconds"] == 3.0
    assert s["policy_lag_max"] == 1
    assert s["idle_train_seconds"] == 10.0 and s["idle_draft_seconds"] == 1.0


def test_table_has_a_row_per_configuration_and_dashes_for_missing_roles():
    rows = [summarize("colocate", "sync", [_rec(1, 80.0, 30.0, 0, idle_draft=False)], 80.0),
            summarize("split", "async", [_rec(1, 40.0, 3.0, 1)], 40.0)]
    for r in rows:
        r["speedup_vs_sync_colocate"] = rows[0]["step_seconds_median"] / r["step_seconds_median"]
    lines = format_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("colocate/sync") and lines[2].endswith("1.00x")
    assert lines[3].startswith("split/async") and lines[3].endswith("2.00x")
    assert " - " in lines[2] + " "  # no DraftTrainer idle figure where none was logged


def test_refuses_a_run_dir_with_results(tmp_path, capsys):
    (tmp_path / "sync-colocate").mkdir()
    assert main(["--run-dir", str(tmp_path), "--out", str(tmp_path / "out.json")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("bad", ["grpo.group_size=1", "data.name=nope"])
def test_bad_overrides_stop_before_any_run(tmp_path, capsys, bad):
    assert main(["--run-dir", str(tmp_path / "r"), bad]) == 2
    assert "error:" in capsys.readouterr().err
