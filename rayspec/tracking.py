"""Experiment trackers (``trainer.report_to``, TRL's name): TensorBoard, W&B
and MLflow, each through its own library, from the driver only.

The driver follows ``<run_dir>/metrics.jsonl`` (``RecordFollower``), which
rank 0 writes one record per step, and hands each new record to every
tracker: one process talks to the trackers whatever restarts the Train
workers go through, and none of them runs beside a Train rank or a replica.
The config goes to each once, at ``open_trackers``, before any role starts, so a
tracker that cannot be reached stops the run before its first step; the
curves picture and the trained policy's and draft head's paths at the end.

Each tracker's run continues where a resumed run left it: its id is kept in
``<run_dir>/trackers.json``. A step the Train workers ran again after a
failure (``MetricsLog.discard_after``) is logged again, at the same step.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

from rayspec.config import ConfigError, RunConfig
from rayspec.files import write_text_atomic

log = logging.getLogger(__name__)

# trainer.report_to's names -> (module to import, the extra that installs it)
TRACKERS = {"tensorboard": ("tensorboardX", None), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
TRACKER_IDS = "trackers.json"  # in the run directory: each tracker's run id, for a resume

# record keys holding one rate per draft position -> their tag
PER_POSITION_TAGS = {"acceptance_rate_per_pos": "acceptance_rate", "draft_acceptance_estimate": "acceptance_estimate"}
GROUPED_TAGS = ("rewards",)  # record keys holding {name: number}: tags <key>/<name>


def scalars(record: dict[str, Any]) -> Iterator[tuple[str, float, str, int]]:
    """A step record's numbers as (tag, value, x axis, x): every number at
    ``step`` (lists per draft position as ``<tag>/pos<i>``, ``{name:
    number}`` groups as ``<key>/<name>``), each held-out evaluation's as
    ``eval/<key>`` at the policy version it scored (x axis
    ``eval/policy_version``). Booleans, and values
    that are not finite (JSON null in metrics.jsonl), are left out."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    step = record["step"]
    for k, v in record.items():
        if k != "step" and number(v):
            yield k, v, "step", step
        elif k in PER_POSITION_TAGS:
            for i, r in enumerate(v):
                if number(r):
                    yield f"{PER_POSITION_TAGS[k]}/pos{i + 1}", r, "step", step
        elif k in GROUPED_TAGS:
            for name, r in v.items():
                if number(r):
                    yield f"{k}/{name}", r, "step", step
    for ev in record.get("evals", []):
        for k, v in ev.items():
            if k != "policy_version" and number(v):
                yield f"eval/{k}", v, "eval/policy_version", ev["policy_version"]


def flat_config(cfg: RunConfig) -> dict[str, Any]:
    """The run's config as {dotted key: value} (lists and dicts below the
    sections' own fields as JSON text), as trackers take parameters."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}

    def walk(prefix: str, d: dict) -> None:
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and prefix.count(".") < 1:
                walk(key, v)
            else:
                out[key] = json.dumps(v) if isinstance(v, (list, dict)) else v
    walk("", OmegaConf.to_container(OmegaConf.structured(cfg)))
    return out


class Tracker:
    """One tracker of the run (the driver's).

    Attributes:
        name: its ``trainer.report_to`` name.
        run_id: its run's id (kept in ``trackers.json`` for a resume), or None.
    """

    name = ""
    run_id: str | None = None

    def log(self, record: dict[str, Any]) -> None:
        """Log one step record (its ``scalars``)."""
        raise NotImplementedError

    def tick(self) -> None:
        """Called at every look at metrics.jsonl, new records or not."""

    def finish(self, outputs: dict[str, Path], failed: bool = False) -> None:
        """End of run: ``outputs`` {name: path} that exist (``curves``: the
        picture, logged as an artifact; ``policy``, ``draft_head``: their
        paths), then close; ``failed``: the run ended with an error."""
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """TensorBoard event files under ``<run_dir>/tensorboard`` (tensorboardX)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path):
        from tensorboardX import SummaryWriter

        # tensorboardX writes events from a queue on its own thread; flush()
        # does not wait for it, so TensorBoard would lag by up to flush_secs
        # (120 s by default); close() writes everything
        self.tb = SummaryWriter(str(run_dir / "tensorboard"), flush_secs=5)

    def log(self, record: dict[str, Any]) -> None:
        for tag, v, _, x in scalars(record):
            self.tb.add_scalar(tag, v, x)
        self.tb.flush()

    def finish(self, outputs: dict[str, Path], failed: bool = False) -> None:
        for name, path in outputs.items():
            if name != "curves":
                self.tb.add_text(name, str(path))
        self.tb.close()


class WandbTracker(Tracker):
    """A W&B run (``wandb.init``): the project ``trainer.project_name``
    (else ``WANDB_PROJECT``, else rayspec), the run name, tags and mode
    (``trainer.wandb_mode``, else ``WANDB_MODE``: ``offline`` writes the run
    under ``<run_dir>/wandb`` for ``wandb sync``); W&B's other environment
    variables as W&B reads them. Each number is plotted against its x axis
    (``step``, or ``eval/policy_version`` for evaluations: ``define_metric``), so
    a step logged again needs no rewinding of W&B's own step."""

    name = "wandb"

    def __init__(self, cfg: RunConfig, run_dir: Path, run_id: str | None):
        import wandb

        t = cfg.trainer
        self.run = wandb.init(project=t.project_name or os.environ.get("WANDB_PROJECT") or "rayspec",
                              name=t.run_name or run_dir.name, tags=list(t.tags) or None,
                              mode=t.wandb_mode, dir=str(run_dir), id=run_id, resume="allow" if run_id else None,
                              config=flat_config(cfg))
        self.run_id = self.run.id
        self._axes: dict[str, str] = {}
        for axis in ("step", "eval/policy_version"):
            self.run.define_metric(axis, hidden=True)

    def log(self, record: dict[str, Any]) -> None:
        rows: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
        for tag, v, axis, x in scalars(record):
            if self._axes.get(tag) != axis:
                self.run.define_metric(tag, step_metric=axis)
                self._axes[tag] = axis
            rows[axis, x][tag] = v
        for (axis, x), row in rows.items():
            self.run.log({axis: x, **row})

    def finish(self, outputs: dict[str, Path], failed: bool = False) -> None:
        import wandb

        for name, path in outputs.items():
            if name == "curves":
                self.run.log({"curves": wandb.Image(str(path))})
            else:
                self.run.summary[f"{name}_path"] = str(path)
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker(Tracker):
    """An MLflow run through ``MlflowClient``: the tracking URI
    ``trainer.tracking_uri`` (else ``MLFLOW_TRACKING_URI``, else an SQLite
    store ``<run_dir>/mlflow.db`` with artifacts in ``<run_dir>/mlartifacts``:
    MLflow 3 keeps its file store, ``file:...``, behind
    ``MLFLOW_ALLOW_FILE_STORE=true``), the experiment ``trainer.project_name`` (else
    ``MLFLOW_EXPERIMENT_NAME``, else rayspec), the run name and tags; the
    config as parameters. A step logged again adds a second value at that step."""

    name = "mlflow"

    def __init__(self, cfg: RunConfig, run_dir: Path, run_id: str | None):
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        t = cfg.trainer
        uri = t.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if uri is None:
            uri, artifacts = f"sqlite:///{run_dir / 'mlflow.db'}", (run_dir / "mlartifacts").as_uri()
        # a server that cannot be reached fails here at once, not after MLflow's 7 retries with backoff
        with _env_default(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="20"):
            self.client = MlflowClient(tracking_uri=uri)
            name = t.project_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rayspec"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment
                             else self.client.create_experiment(name, artifact_location=artifacts))
            if run_id is None:
                run = self.client.create_run(experiment_id, run_name=t.run_name or run_dir.name,
                                             tags={tag: "" for tag in t.tags})
                self.run_id = run.info.run_id
                params = [Param(k, str(v)) for k, v in flat_config(cfg).items()]
                for i in range(0, len(params), 100):  # MLflow's batch holds at most 100 params
                    self.client.log_batch(self.run_id, params=params[i:i + 100], tags=[] if i else [
                        RunTag("rayspec.run_dir", str(run_dir))])
            else:
                self.run_id = run_id
                self.client.update_run(run_id, status="RUNNING")
        self.uri = uri

    def log(self, record: dict[str, Any]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, float(v), now, x) for tag, v, _, x in scalars(record)]
        for i in range(0, len(metrics), 1000):  # MLflow's batch holds at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self, outputs: dict[str, Path], failed: bool = False) -> None:
        for name, path in outputs.items():
            if name == "curves":
                self.client.log_artifact(self.run_id, str(path))
            else:
                self.client.set_tag(self.run_id, f"{name}_path", str(path))
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


@contextlib.contextmanager
def _env_default(**values: str):
    """Set environment variables the user has not set, for the block."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def check_trackers_installed(cfg: RunConfig) -> None:
    """Every tracker ``trainer.report_to`` names can be imported.

    Raises:
        ConfigError: one is not installed (with the extra that installs it).
    """
    for name in cfg.trainer.report_to:
        if name == "none":
            continue
        module, extra = TRACKERS[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"trainer.report_to: {name} needs the {module} package, which is not installed "
                              f"({e}): pip install 'rayspec[{extra}]'") from None


def open_trackers(cfg: RunConfig, run_dir: Path) -> list[Tracker]:
    """Start (or, for a resumed run, continue) a run in each tracker of
    ``trainer.report_to`` and log the config to it; their ids go to
    ``<run_dir>/trackers.json``.

    Raises:
        ConfigError: a tracker's run cannot be started (its library
            missing: ``check_trackers_installed`` says so earlier, before
            Ray; an unreachable tracking URI; W&B without a login in online
            mode), naming ``trainer.report_to`` and the library's error. The
            trackers already started are closed.
    """
    ids_path = run_dir / TRACKER_IDS
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    kinds = {"tensorboard": lambda _: TensorBoardTracker(run_dir),
             "wandb": lambda rid: WandbTracker(cfg, run_dir, rid),
             "mlflow": lambda rid: MlflowTracker(cfg, run_dir, rid)}
    opened: list[Tracker] = []
    for name in cfg.trainer.report_to:
        if name == "none":
            continue
        try:
            opened.append(kinds[name](ids.get(name)))
        except Exception as e:  # noqa: BLE001 - each library has its own errors; all stop the run here
            for t in opened:
                _finish_quietly(t)
            key = "trainer.tracking_uri" if name == "mlflow" and cfg.trainer.tracking_uri else "trainer.report_to"
            raise ConfigError(f"{key}: {name} could not start a run: {type(e).__name__}: {e}") from e
    ids.update({t.name: t.run_id for t in opened if t.run_id})
    if ids:
        write_text_atomic(ids_path, json.dumps(ids, indent=1))
    log.info("trackers: %s", ", ".join(_where(t, run_dir) for t in opened) or "none")
    return opened


def _where(t: Tracker, run_dir: Path) -> str:
    if isinstance(t, TensorBoardTracker):
        return f"tensorboard ({run_dir / 'tensorboard'})"
    if isinstance(t, MlflowTracker):
        return f"mlflow (run {t.run_id} at {t.uri})"
    return f"wandb (run {t.run_id}, {t.run.settings.mode}: {t.run.dir})"


def _finish_quietly(t: Tracker) -> None:
    try:
        t.finish({}, failed=True)
    except Exception:  # noqa: BLE001 - closing after another failure
        log.exception("closing the %s tracker failed", t.name)


class RecordFollower:
    """A driver thread that reads ``<run_dir>/metrics.jsonl`` every
    ``poll_s`` seconds and gives each record not seen before to every
    tracker. A tracker that raises is reported and dropped; the run goes
    on, its records still in metrics.jsonl.

    Args:
        run_dir: the run directory (every node's, so the driver's too).
        trackers: from ``open_trackers``.
        skip_existing: records already there are not logged (a resumed run:
            its earlier driver logged them).
    """

    def __init__(self, run_dir: Path, trackers: list[Tracker], skip_existing: bool = False,
                 poll_s: float = 2.0):
        self.path, self.trackers, self.poll_s = run_dir / "metrics.jsonl", list(trackers), poll_s
        self._seen: set[str] = set(self._lines()) if skip_existing else set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rayspec-record-follower", daemon=True)

    def __enter__(self) -> "RecordFollower":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # the records written since the last look

    def _lines(self) -> list[str]:
        try:
            return self.path.read_text().splitlines()
        except FileNotFoundError:
            return []

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> int:
        """Log the records not logged yet; returns how many."""
        new = [line for line in self._lines() if line and line not in self._seen]
        for line in new:
            self._seen.add(line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line being appended (the writer flushes whole lines)
                self._seen.discard(line)
                break
            for t in list(self.trackers):
                try:
                    t.log(record)
                except Exception as e:  # noqa: BLE001 - a tracker's failure is not the run's
                    self._drop(t, f"at step {record.get('step')}", e)
        for t in list(self.trackers):
            try:
                t.tick()
            except Exception as e:  # noqa: BLE001
                self._drop(t, "", e)
        return len(new)

    def _drop(self, t: Tracker, when: str, e: Exception) -> None:
        log.warning("trainer.report_to: %s failed%s (%s: %s); the run goes on without it, every record stays "
                    "in %s", t.name, f" {when}" if when else "", type(e).__name__, e, self.path)
        self.trackers.remove(t)
        _finish_quietly(t)

    def finish(self, outputs: dict[str, Path], failed: bool = False) -> None:
        """Close every tracker with the run's ``outputs`` that exist
        (``failed``: the run ended with an error)."""
        outputs = {k: p for k, p in outputs.items() if p.exists()}
        for t in self.trackers:
            try:
                t.finish(outputs, failed)
            except Exception as e:  # noqa: BLE001 - the run is done; its files stay
                log.warning("trainer.report_to: closing %s failed (%s: %s)", t.name, type(e).__name__, e)
