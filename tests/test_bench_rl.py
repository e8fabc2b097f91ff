"""jobs.bench_rl: the three runs differ only in speculation and draft
training, and the table/JSON/plot come from their metrics."""

from __future__ import annotations

from jobs.bench_rl import DEFAULT_PRESET, format_table, main, plot, runs, summarize
from rayspec.config import load_config


def _records(acc: list[float]) -> list[dict]:
    return [{"acceptance_length": a, "rollout_tokens_per_s": 10.0 * a, "reward_mean": 0.1 * i,
             "time_step_s": 50.0, "time_rollout_s": 20.0} for i, a in enumerate(acc)]


def test_runs_differ_only_in_speculation_and_draft_training(tmp_path, gsm8k_dir):
    head = tmp_path / "head"
    head.mkdir()
    base = [f"data.path={gsm8k_dir}"]
    cfgs = {n: load_config(DEFAULT_PRESET, base + o) for n, o in runs(str(head)).items()}
    assert cfgs["none"].rollout.speculative_config.method is None
    for n in ("frozen", "online"):
        assert cfgs[n].rollout.speculative_config.model == str(head)
    assert not cfgs["frozen"].draft.enabled and cfgs["online"].draft.enabled
    assert len({(c.data.name, c.data.seed, c.trainer.seed, c.grpo.max_new_tokens) for c in cfgs.values()}) == 1


def test_table_and_plot(tmp_path):
    rows = [summarize("frozen", _records([2.0, 1.8, 1.5]), 1.0),
            summarize("online", _records([2.0, 2.1, 2.2]), 1.0)]
    assert rows[0]["acceptance_length_median"] == 1.8
    table = format_table(rows)
    assert "frozen" in table and table.count("\n") == 4
    assert plot(rows, tmp_path / "rl.png").read_bytes()[:4] == b"\x89PNG"


def test_refuses_unknown_run_and_non_empty_run_dir(tmp_path, capsys):
    assert main(["--warm-head", str(tmp_path), "--runs", "none,fast", "--run-dir", str(tmp_path / "r")]) == 2
    assert "unknown ['fast']" in capsys.readouterr().err
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "x").write_text("kept")
    assert main(["--warm-head", str(tmp_path), "--run-dir", str(tmp_path / "r")]) == 2
    assert (tmp_path / "r" / "x").read_text() == "kept"
