"""trainer.report_to: TensorBoard, W&B (offline) and MLflow (its SQLite
store) follow metrics.jsonl from the driver; each run read back with the
library's own reader; bad input stops the run before its first step, a
tracker failing mid-run does not."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest

from rayspec.config import ConfigError, load_config
from rayspec.metrics import MetricsLog, plot_run
from rayspec.tracking import (TRACKER_IDS, RecordFollower, Tracker, check_trackers_installed, open_trackers,
                              scalars)


def wandb_offline_history(run_dir: Path) -> tuple[list[dict], dict, dict]:
    """(history rows, config, summary) of the W&B offline runs under
    ``<run_dir>/wandb``, oldest first, read from their ``.wandb`` files with
    W&B's own record type (``wandb.proto.wandb_internal_pb2.Record``).
    W&B ships no Python reader of these files since its core moved to Go
    (wandb-core): the framing is LevelDB's log format (32 KiB blocks, chunks
    of crc32 / length / type), after a 7-byte ``:W&B`` header."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows, config, summary = [], {}, {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, buf = 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:  # a block's tail too short for a chunk header: padding
                pos += left
                continue
            _, n, kind = struct.unpack_from("<IHB", data, pos)
            if n == 0 and kind == 0:
                pos += left
                continue
            buf += data[pos + 7:pos + 7 + n]
            pos += 7 + n
            if kind in (1, 4):  # FULL, LAST
                rec = pb.Record()
                rec.ParseFromString(buf)
                buf = b""
                which = rec.WhichOneof("record_type")
                if which == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
                elif which == "run":
                    config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
                elif which == "summary":
                    summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                    for i in rec.summary.update})
    return rows, config, summary


def _record(step: int, **kw) -> dict:
    return {"step": step, "reward_mean": 0.25 * step, "acceptance_length": 1.5, "policy_version": step,
            "acceptance_rate_per_pos": [0.5, 0.25], "rewards": {"math_verify": 0.5, "format": None},
            "draft_loss": float("nan"), "rollout_tokens_per_s": 10.0, "time_rollout_s": 1.0,
            "response_lens": [3, 4], "reward_mean_was_clipped": False, **kw}


def test_report_to_names_known_trackers_once():
    assert load_config(None, []).trainer.report_to == ["tensorboard"]
    for bad, why in (("[tensorboard,wandbb]", "unknown tracker 'wandbb'"), ("[none,wandb]", "none excludes"),
                     ("[mlflow,mlflow]", "names a tracker twice")):
        with pytest.raises(ConfigError, match=rf"trainer\.report_to.*{why}"):
            load_config(None, [f"trainer.report_to={bad}"])
    with pytest.raises(ConfigError, match=r"trainer\.wandb_mode"):
        load_config(None, ["trainer.wandb_mode=cloud"])


def test_a_tracker_not_installed_is_named_with_its_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"trainer\.report_to: wandb needs the wandb package.*rayspec\[wandb\]"):
        check_trackers_installed(load_config(None, ["trainer.report_to=[tensorboard,wandb]"]))
    check_trackers_installed(load_config(None, ["trainer.report_to=[none]"]))


def test_scalars_put_evaluations_at_their_policy_version():
    rec = _record(3, evals=[{"policy_version": 2, "reward_greedy": 0.5, "greedy_changed": 0.0}])
    got = {tag: (v, axis, x) for tag, v, axis, x in scalars(rec)}
    assert got["reward_mean"] == (0.75, "step", 3) and got["acceptance_rate/pos2"] == (0.25, "step", 3)
    assert got["rewards/math_verify"] == (0.5, "step", 3) and "rewards/format" not in got
    assert got["eval/reward_greedy"] == (0.5, "eval/policy_version", 2) and got["policy_version"] == (3, "step", 3)
    assert "draft_loss" not in got and "reward_mean_was_clipped" not in got and "response_lens" not in got


def _cfg(run_dir: Path, *extra: str):
    return load_config(None, ["trainer.report_to=[tensorboard,wandb,mlflow]", "trainer.wandb_mode=offline",
                              "trainer.project_name=rl-tests", "trainer.run_name=run-a", "trainer.tags=[t1]",
                              f"trainer.run_dir={run_dir}", *extra])


@pytest.fixture
def tracker_env(monkeypatch, tmp_path):
    """No tracker setting from the environment reaches the test (W&B's
    and MLflow's own variables are honoured: the test sets none)."""
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def test_each_tracker_gets_the_config_every_record_and_the_outputs(tmp_path, tracker_env):
    """Two steps through W&B (offline) and MLflow (SQLite), read back with
    each library's reader; a resumed run continues both runs and does not
    log again what its earlier driver logged; a step run again after a
    failure is logged again."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir)
    log = MetricsLog(run_dir)
    follower = RecordFollower(run_dir, open_trackers(cfg, run_dir))
    ids = json.loads((run_dir / TRACKER_IDS).read_text())
    assert set(ids) == {"wandb", "mlflow"}
    log.write(_record(1, evals=[{"policy_version": 0, "reward_greedy": 0.25, "reward_sampled": 0.125,
                                 "acceptance_length": 1.25, "greedy_changed": 0.0}]))
    log.write(_record(2))
    assert follower.poll() == 2 and follower.poll() == 0
    plot_run(run_dir)
    (run_dir / "policy").mkdir()
    follower.finish({"curves": run_dir / "curves.png", "policy": run_dir / "policy",
                     "draft_head": run_dir / "draft_head"})  # no head: not named

    rows, config, summary = wandb_offline_history(run_dir)
    assert [(r["step"], r["reward_mean"]) for r in rows if "reward_mean" in r] == [(1, 0.25), (2, 0.5)]
    assert [(r["eval/policy_version"], r["eval/reward_greedy"]) for r in rows if "eval/reward_greedy" in r] == [
        (0, 0.25)]
    assert config["trainer.steps"] == 10 and config["grpo.group_size"] == cfg.grpo.group_size
    assert summary["policy_path"] == str(run_dir / "policy") and "draft_head_path" not in summary
    assert [r["curves/_type"] for r in rows if "curves/_type" in r] == ["image-file"]

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(ids["mlflow"])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED" and "t1" in run.data.tags
    assert client.get_experiment(run.info.experiment_id).name == "rl-tests"
    assert run.data.params["trainer.run_dir"] == str(run_dir) and run.data.params["trainer.steps"] == "10"
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "reward_mean")] == [(1, 0.25),
                                                                                                   (2, 0.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "eval/reward_greedy")] == [(0, 0.25)]
    assert run.data.tags["policy_path"] == str(run_dir / "policy")
    assert [a.path for a in client.list_artifacts(ids["mlflow"])] == ["curves.png"]

    # resumed from step 1's checkpoint: step 2 is discarded, runs again and is logged again; step 1 is not
    follower = RecordFollower(run_dir, open_trackers(cfg, run_dir), skip_existing=True)
    assert json.loads((run_dir / TRACKER_IDS).read_text()) == ids
    log.discard_after(1)
    log.write(_record(2, reward_mean=0.75))
    assert follower.poll() == 1
    follower.finish({})
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "reward_mean")] == [
        (1, 0.25), (2, 0.5), (2, 0.75)]
    rows, _, _ = wandb_offline_history(run_dir)
    assert [(r["step"], r["reward_mean"]) for r in rows if "reward_mean" in r] == [(1, 0.25), (2, 0.5), (2, 0.75)]


def test_a_tracker_that_cannot_start_stops_the_run_naming_the_key(tmp_path, tracker_env, monkeypatch):
    """An MLflow server that is not there fails at once (no retries); W&B
    online without a login names the key; what was opened before is closed."""
    import time

    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"trainer\.tracking_uri: mlflow could not start a run: .*127\.0\.0\.1:9"):
        open_trackers(_cfg(tmp_path / "a", "trainer.tracking_uri=http://127.0.0.1:9"), tmp_path / "a")
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "a" / TRACKER_IDS).exists()
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"trainer\.report_to: wandb could not start a run: .*API key"):
        open_trackers(_cfg(tmp_path / "b", "trainer.wandb_mode=online"), tmp_path / "b")


def test_a_tracker_failing_mid_run_is_dropped_and_the_run_goes_on(tmp_path, caplog):
    class Flaky(Tracker):
        name = "flaky"

        def __init__(self):
            self.steps, self.finished = [], None

        def log(self, record):
            if record["step"] == 2:
                raise ConnectionError("tracker went away")
            self.steps.append(record["step"])

        def finish(self, outputs, failed=False):
            self.finished = failed

    class Steady(Flaky):
        def log(self, record):
            self.steps.append(record["step"])

    flaky, steady = Flaky(), Steady()
    log = MetricsLog(tmp_path)
    follower = RecordFollower(tmp_path, [flaky, steady])
    with caplog.at_level(logging.WARNING, logger="rayspec.tracking"):
        for s in (1, 2, 3):
            log.write(_record(s))
            follower.poll()
    follower.finish({})
    assert flaky.steps == [1] and flaky.finished is True and steady.steps == [1, 2, 3] and steady.finished is False
    assert "flaky failed at step 2 (ConnectionError: tracker went away); the run goes on without it" in caplog.text
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
