"""``ray job submit`` end to end: a ``ray start --head`` cluster on loopback,
``jobs.grpo`` submitted through the Jobs SDK with the repo as working_dir,
and the step metrics read back from the node's Prometheus endpoint while
the job runs (what the Ray dashboard's metrics view shows)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
GAUGES = ("rayspec_rollout_tokens_per_s", "rayspec_acceptance_length", "rayspec_acceptance_rate",
          "rayspec_reward_mean", "rayspec_policy_version", "rayspec_phase_seconds",
          "rayspec_response_tokens_count")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, list[str]]:
    """rayspec samples on the metrics endpoint: {metric name: [sample lines]}."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"ray_(rayspec_\w+)\{", line)
        if m:
            out.setdefault(m.group(1), []).append(line)
    return out


@pytest.fixture
def head_node():
    """A one-node Ray cluster started with ``ray start --head`` on 127.0.0.1;
    yields (JobSubmissionClient, metrics port); stops its jobs (``ray stop``
    leaves a job's driver process running) and the cluster afterwards."""
    from ray.job_submission import JobSubmissionClient

    # short temp dir: Ray's unix sockets live under it (108-byte path limit)
    temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    dash, metrics = _free_port(), _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled",
           # export every second, so a short job's gauges reach the endpoint
           "RAY_metrics_report_interval_ms": "1000"}
    subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={_free_port()}",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                    f"--metrics-export-port={metrics}", "--num-cpus=2",
                    f"--object-store-memory={1 << 30}", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                   env=env, check=True, capture_output=True, timeout=180)
    try:
        client = JobSubmissionClient(f"http://127.0.0.1:{dash}")
        yield client, metrics
        for job in client.list_jobs():
            if not job.status.is_terminal():
                client.stop_job(job.submission_id)
                _wait(client, job.submission_id, 60)
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def _wait(client, job: str, timeout_s: float, on_poll=lambda: None):
    """Poll until the job is terminal; returns its JobStatus."""
    deadline = time.time() + timeout_s
    while not (status := client.get_job_status(job)).is_terminal():
        assert time.time() < deadline, f"job {job} still {status} after {timeout_s} s"
        on_poll()
        time.sleep(1)
    return status


@pytest.mark.slow
def test_job_submit_runs_grpo_and_exports_dashboard_metrics(head_node, tiny_llama_dir, tmp_path):
    from ray.job_submission import JobStatus

    client, metrics_port = head_node
    run_dir = tmp_path / "job"
    job = client.submit_job(
        entrypoint=(f"{sys.executable} -m jobs.grpo model.path={tiny_llama_dir} model.dtype=float32 "
                    f"trainer.steps=2 trainer.run_dir={run_dir} grpo.max_new_tokens=24 "
                    "data.prompts_per_step=2 draft.steps_per_rl_step=1"),
        runtime_env={"working_dir": str(REPO), "excludes": [".venv", ".git", "runs", "*.egg-info"]},
    )
    seen: dict[str, list[str]] = {}  # the latest export of each metric
    status = _wait(client, job, 600, lambda: seen.update(_scrape(metrics_port)))
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert re.search(r"step +2 \| reward [0-9.]+ \| accept_len", logs), logs[-3000:]
    assert f"done: {run_dir / 'metrics.jsonl'}" in logs
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]

    # the dashboard's metrics: the per-step gauges, tagged with run, method and replica
    assert set(GAUGES) <= seen.keys(), sorted(seen)
    tokens = seen["rayspec_rollout_tokens_per_s"]
    assert any('replica="all"' in line and 'method="eagle3"' in line and 'run="job"' in line
               for line in tokens), tokens
    replicas = {re.search(r'replica="([^"]+)"', line).group(1) for line in tokens}
    assert replicas - {"all"} == set(recs[-1]["replicas"]), tokens  # and each replica's own
    positions = {re.search(r'position="(\d)"', line).group(1) for line in seen["rayspec_acceptance_rate"]}
    assert positions == {"1", "2", "3"}
    assert any('phase="policy"' in line for line in seen["rayspec_phase_seconds"])
    (count,) = [line for line in seen["rayspec_response_tokens_count"]]
    assert float(count.rsplit(" ", 1)[1]) >= len(recs[0]["response_lens"])
