"""metrics.jsonl, the TensorBoard scalars the driver's follower writes from
it, the step line and the curves plot."""

from __future__ import annotations

import json

import pytest

from rayspec.metrics import MetricsLog, format_step_line, plot_run, read_metrics
from rayspec.tracking import RecordFollower, TensorBoardTracker


def _record(step: int) -> dict:
    return {"step": step, "reward_mean": 0.25 * step, "acceptance_length": 1.0 + 0.1 * step,
            "acceptance_rate_per_pos": [0.1 * step, 0.0, 0.0], "rollout_tokens_per_s": 100.0,
            "time_rollout_s": 10.0, "time_policy_s": 20.0, "time_draft_s": 5.0,
            "time_sync_s": 1.0, "policy_version": step - 1, "draft_loss": float("nan")}


def test_log_writes_jsonl_tensorboard_and_plot(tmp_path):
    log = MetricsLog(tmp_path)
    for s in (1, 2):
        log.write(_record(s))
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["draft_loss"] is None  # NaN is not JSON
    assert recs[1]["acceptance_rate_per_pos"] == pytest.approx([0.2, 0.0, 0.0])
    tb = _follow(tmp_path)
    assert tb["acceptance_rate/pos1"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert "draft_loss" not in tb  # NaN: no point
    png = plot_run(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    line = format_step_line(recs[1])
    assert "step    2" in line and "accept_len 1.20" in line and "v1" in line and "draft 5.0s" in line
    assert "draft idle sync" in format_step_line({**recs[1], "draft_trained": 0})
    assert "reward 0.500 (math_verify 0.25, boxed_once n/a) 2 zeroed | dropped 3 groups, 2 rounds |" in \
        format_step_line({**recs[1], "rewards": {"math_verify": 0.25, "boxed_once": None}, "reward_errors": 2,
                          "groups_dropped": 3, "sampling_rounds": 2})
    assert "reward 0.500 | accept_len" in format_step_line({**recs[1], "rewards": {"last_number": 0.5}})


def _follow(run_dir) -> dict[str, list[tuple[int, float]]]:
    """The driver's TensorBoard tracker follows ``run_dir``'s metrics.jsonl
    to the end; returns its scalars (``_scalars``)."""
    follower = RecordFollower(run_dir, [TensorBoardTracker(run_dir)])
    assert follower.poll() == len(read_metrics(run_dir)) and follower.poll() == 0  # each record once
    follower.finish({})
    return _scalars(run_dir / "tensorboard")


def _scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of a TensorBoard event file (TFRecord framing:
    u64 length, u32 crc, Event proto, u32 crc)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    data = next(tb_dir.glob("events.out.tfevents.*")).read_bytes()
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        event = Event.FromString(data[pos + 12:pos + 12 + n])
        pos += 12 + n + 4
        for v in event.summary.value:
            out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_evaluations_go_to_tensorboard_at_their_policy_version_and_into_the_plot(tmp_path):
    log = MetricsLog(tmp_path)
    ev = {"reward_greedy": 0.25, "reward_sampled": 0.125, "acceptance_length": 1.5, "time_s": 3.0}
    log.write({**_record(1), "kl": 0.0, "evals": [{"policy_version": 0, **ev, "greedy_changed": 0.0}]})
    log.write({**_record(2), "kl": 0.02, "evals": [{"policy_version": 2, **ev, "greedy_changed": 0.5}]})
    tb = _follow(tmp_path)
    assert tb["eval/greedy_changed"] == [(0, 0.0), (2, 0.5)]
    assert tb["eval/reward_greedy"] == [(0, 0.25), (2, 0.25)]
    assert tb["kl"] == [(1, 0.0), (2, pytest.approx(0.02))]
    assert "eval/policy_version" not in tb
    assert plot_run(tmp_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_reward_function_and_the_dynamic_sampling_counts_go_to_tensorboard(tmp_path):
    log = MetricsLog(tmp_path)
    log.write({**_record(1), "rewards": {"math_verify": 0.5, "boxed_once": None}, "reward_errors": 1,
               "groups_dropped": 3, "sampling_rounds": 2})
    tb = _follow(tmp_path)
    assert tb["rewards/math_verify"] == [(1, 0.5)] and "rewards/boxed_once" not in tb  # applied to no sample
    assert tb["reward_errors"] == [(1, 1.0)] and tb["groups_dropped"] == [(1, 3.0)]
    assert tb["sampling_rounds"] == [(1, 2.0)]


def test_dashboard_exports_drift_and_the_last_evaluation():
    """The Ray dashboard's gauges get the step's ``kl`` and the held-out
    rewards of the record's last evaluation (none where the record has none)."""
    from rayspec.metrics import DashboardMetrics

    class Recorder:
        def __init__(self):
            self.calls = []

        def set(self, value, tags):
            self.calls.append((value, tags))

    dash = DashboardMetrics("run1", "eagle3", 48)
    dash.kl, dash.eval_reward = Recorder(), Recorder()
    base = {**_record(1), "response_lens": [3, 5]}
    dash.record(base)  # no KL term, no evaluation
    assert dash.kl.calls == [] and dash.eval_reward.calls == []
    evals = [{"policy_version": v, "reward_greedy": g, "reward_sampled": s}
             for v, g, s in ((0, 0.1, 0.05), (1, 0.75, 0.5))]
    dash.record({**base, "kl": 0.03, "evals": evals})
    assert dash.kl.calls == [(0.03, {"run": "run1"})]
    assert dash.eval_reward.calls == [(0.75, {"run": "run1", "mode": "greedy"}),
                                      (0.5, {"run": "run1", "mode": "sampled"})]


def test_read_metrics_names_the_bad_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_record(1)) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_step_line_shows_the_adaptive_k_schedule_and_why_once_per_distinct_schedule():
    rec = _record(1)
    why = "k 3 at 1-6 seqs: a step costs 1.45x plain; draft 2.10 tok/step > 1.52"
    rec["replicas"] = {"a": {"k_schedule": [[1, 6, 3], [7, 64, 0]], "k_reason": why},
                       "b": {"k_schedule": [[1, 6, 3], [7, 64, 0]], "k_reason": why}}
    assert format_step_line(rec).count(f"| k 1-6:3 7-64:0 ({why}) |") == 1
    assert "| k " not in format_step_line(_record(1))


def test_the_draft_estimate_is_on_every_step_line_and_plotted_against_the_measured_length(tmp_path):
    """The DraftTrainer's estimate of the head's acceptance length shows on
    the step line, with its age where the head did not train this step, and
    in curves.png beside the acceptance measured in rollouts that drafted;
    TensorBoard gets it as a scalar."""
    rec = {**_record(2), "draft_acceptance_length_estimate": 1.234, "draft_estimate_age": 0}
    assert "| draft est 1.23 | rollout" in format_step_line(rec)
    assert "| draft est 1.23 (1 step old) |" in format_step_line({**rec, "draft_estimate_age": 1})
    assert "(3 steps old)" in format_step_line({**rec, "draft_estimate_age": 3})
    assert "draft est" not in format_step_line(_record(2))
    log = MetricsLog(tmp_path)
    log.write({**_record(1), "num_drafts": 0})  # measured nothing: not plotted as 1.0
    log.write(rec)
    plot_run(tmp_path)
    assert _follow(tmp_path)["draft_acceptance_length_estimate"] == [(2, pytest.approx(1.234))]


def test_discard_after_moves_later_steps_aside(tmp_path):
    """Restoring the step-2 checkpoint after an attempt that logged steps 3-4:
    metrics.jsonl keeps steps 1-2 (whole lines), the rest move to
    metrics.discarded.jsonl, and a later write appends after step 2."""
    def steps(name):
        return [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()]

    log = MetricsLog(tmp_path)
    for step in range(1, 5):
        log.write({"step": step, "reward_mean": step / 10})
    assert [r["step"] for r in log.discard_after(2)] == [3, 4]
    assert steps("metrics.jsonl") == [1, 2]
    assert steps("metrics.discarded.jsonl") == [3, 4]
    log.write({"step": 3, "reward_mean": 0.5})
    assert steps("metrics.jsonl") == [1, 2, 3]
    assert log.discard_after(3) == []
