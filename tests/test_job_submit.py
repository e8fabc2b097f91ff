"""``ray job submit`` end to end on a ``ray start --head`` cluster on loopback,
through the Jobs SDK with the repo as working_dir:

- ``jobs.grpo`` with a LoRA policy (adapter refits, speculation on): the job
  succeeds, its logs hold the step lines, and the step metrics are read back
  from the node's Prometheus endpoint while it runs (what the Ray dashboard's
  metrics view shows);
- ``jobs.serve``: a run's policy and EAGLE-3 head stay deployed after the job
  returns, answer OpenAI chat completions (plain and streaming) on
  127.0.0.1, and vLLM's spec-decode counters on the endpoint show that the
  answers were decoded speculatively.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import STEP_RECORD_KEYS

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
GAUGES = ("rayspec_rollout_tokens_per_s", "rayspec_acceptance_length", "rayspec_acceptance_rate",
          "rayspec_reward_mean", "rayspec_policy_version", "rayspec_phase_seconds",
          "rayspec_response_tokens_count", "rayspec_kl")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int, prefix: str = "rayspec_") -> dict[str, list[str]]:
    """Samples of the metrics named ``ray_<prefix>*`` on the node's metrics
    endpoint: {metric name without ``ray_``: [sample lines]}."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(rf"ray_({prefix}\w*)\{{", line)
        if m:
            out.setdefault(m.group(1), []).append(line)
    return out


@pytest.fixture(scope="module")
def head_node():
    """A one-node Ray cluster started with ``ray start --head`` on 127.0.0.1;
    yields (JobSubmissionClient, metrics port, the Serve HTTP port, the
    session's ``logs/`` directory); stops its jobs (``ray stop``
    leaves a job's driver process running) and the cluster afterwards."""
    import ray
    from ray.job_submission import JobSubmissionClient

    # no Ray in this process (the shared session's tests run last): `ray stop` below stops every Ray process
    ray.shutdown()
    # short temp dir: Ray's unix sockets live under it (108-byte path limit)
    temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    dash, metrics, http = _free_port(), _free_port(), _free_port()
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
        yield client, metrics, http, Path(temp_dir) / "session_latest" / "logs"
        for job in client.list_jobs():
            if not job.status.is_terminal():
                client.stop_job(job.submission_id)
                _wait(client, job.submission_id, 60)
    finally:
        # Serve apps first, so their vLLM engines shut down: `ray stop` kills
        # the replicas and would leave each engine's EngineCore orphaned
        subprocess.run([str(Path(RAY).with_name("serve")), "shutdown", "-y",
                        f"--address=http://127.0.0.1:{dash}"], env=env, capture_output=True, timeout=120)
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


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

    client, metrics_port, _, logs_dir = head_node
    run_dir = tmp_path / "job"
    job = client.submit_job(
        entrypoint=(f"{sys.executable} -m jobs.grpo model.path={tiny_llama_dir} model.dtype=float32 "
                    f"trainer.steps=3 trainer.run_dir={run_dir} grpo.max_new_tokens=24 "
                    "data.prompts_per_step=2 grpo.group_size=4 draft.steps_per_rl_step=2 "
                    # the head never counts as learning after its second training step,
                    # so a step whose rollout drafts nothing skips its training
                    "draft.min_acceptance_gain=100 draft.idle_train_every=2 "
                    # no evaluation: the first generate is then step 1's rollout, with k=3 everywhere
                    "trainer.eval_every=0 rollout.adaptive_k.enabled=true "
                    # a LoRA policy: adapter refits registered on the AsyncLLM replica, speculation on
                    "train.lora.enabled=true train.lora.r=8 train.lora.save_merged=true "
                    "train.deepspeed.optimizer.params.lr=1e-3 "
                    f"model.cache_dir={tmp_path / 'cache'}"),
        runtime_env={"working_dir": str(REPO), "excludes": [".venv", ".git", "runs", "*.egg-info"]},
    )
    seen: dict[str, list[str]] = {}  # the latest export of each metric
    status = _wait(client, job, 600, lambda: seen.update(_scrape(metrics_port)))
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert re.search(r"step +3 \| reward [0-9.]+ \| accept_len", logs), logs[-3000:]
    assert f"done: {run_dir / 'metrics.jsonl'}" in logs
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    # adaptive k: the first rollout drafts k=3 in its tail, up to 8 sequences
    # (nothing measured yet); each step reports the schedule its rollout used
    assert recs[0]["num_drafts"] > 0
    assert list(recs[0]["replicas"].values())[0]["k_schedule"] == [[1, 8, 3], [9, 64, 0]]  # max_num_seqs 64
    for r in recs:
        assert STEP_RECORD_KEYS <= r.keys()
        assert list(r["replicas"].values())[0]["k_schedule"][0][0] == 1
        assert len(r["acceptance_rate_per_pos"]) == 3
        assert r["rollout_tokens_per_s"] > 0
        assert r["time_policy_s"] > 0 and r["time_sync_s"] > 0
        assert (r["time_draft_s"] > 0) == bool(r["draft_trained"])
        assert r["sample"]["prompt"] and isinstance(r["sample"]["response"], str)
        assert r["sample"]["reward"] in (0.0, 1.0)
    assert [r["policy_version"] for r in recs] == [0, 1, 2]
    # the training cadence: the first two steps train the head (no estimate to
    # compare yet); the third only if its rollout drafted in at least
    # draft.min_drafted_share (0.1) of its tokens (adaptive k turns the tiny
    # untrained head off, so it usually does not)
    assert recs[0]["drafted_share"] == min(1.0, (recs[0]["num_drafts"] + recs[0]["num_accepted_tokens"])
                                           / recs[0]["rollout_tokens"]) > 0.1
    trained = [r["draft_trained"] for r in recs]
    assert trained == [1, 1, int(recs[2]["drafted_share"] >= 0.1)]
    assert [r["draft_version"] for r in recs] == [1, 2, 2 + trained[2]]
    assert (run_dir / "draft_head" / "model.safetensors").is_file()
    assert (run_dir / "policy" / "model.safetensors").is_file()  # the adapter merged in (save_merged)
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    # each refit is the adapter (fp32: 8 x (in + out) of every linear layer), plus the head where it trained;
    # step 1's record holds the initial adapter (B = 0) too, registered before the first rollout
    from rayspec.model_shape import ModelShape

    adapter_bytes = 4 * ModelShape.from_hf_config(tiny_llama_dir).lora_params(8)
    for r in recs:
        assert r["weight_sync_transport"] == "lora_adapter+collective"
        head_bytes = r["weight_sync_bytes"] - (2 if r["step"] == 1 else 1) * adapter_bytes
        assert head_bytes > 0 if r["draft_trained"] else head_bytes == 0, (r["step"], r["weight_sync_bytes"])
    # rayspec's INFO records in the replica reach its stderr (they were dropped):
    # its worker log, which the dashboard shows
    replica_err = "".join(text for p in logs_dir.glob("worker-*.err")
                          if "rayspec.rollout.engine: replica " in (text := p.read_text()))
    assert re.search(r"rayspec.rollout.engine: replica \S+: vLLM 0\.\d+", replica_err), replica_err[-2000:]
    # adaptive k timed nothing before the first rollout: step 1's rollout measured the
    # acceptance and a 3-draft step's cost, step 2's a plain step's, then it chose;
    # the step costs are kept for the next run on this machine
    reasons = [list(r["replicas"].values())[0]["k_reason"] for r in recs]
    assert reasons[:2] == ["k 3 at 1-8 seqs: measuring the draft's acceptance",
                           "k 0: measuring a plain step's cost"], reasons
    assert "measuring" not in reasons[2] and reasons[2] in logs
    assert len(list((tmp_path / "cache" / "step_costs").glob("*.json"))) == 1

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


@pytest.fixture
def finished_run(tmp_path, tiny_llama_dir) -> Path:
    """A run directory as jobs.grpo leaves it: config.yaml, policy/, draft_head/."""
    from omegaconf import OmegaConf

    from rayspec.config import load_config
    from rayspec.draft.eagle3 import init_head, save_head
    from rayspec.models import load_policy
    from rayspec.tools.endpoint import load_run

    run = tmp_path / "trained"
    cfg = load_config(None, [f"model.path={tiny_llama_dir}", "model.dtype=float32",
                             f"trainer.run_dir={run}"])
    run.mkdir()
    OmegaConf.save(OmegaConf.structured(cfg), run / "config.yaml")
    shutil.copytree(tiny_llama_dir, run / "policy")
    save_head(init_head(load_policy(tiny_llama_dir), None, seed=0), run / "draft_head")
    assert load_run(run)[2]["model"] == str(run / "draft_head")
    return run


@pytest.mark.slow
def test_job_submit_serves_the_trained_policy_with_speculation(head_node, finished_run):
    from openai import OpenAI
    from ray.job_submission import JobStatus

    client, metrics_port, http_port, _ = head_node
    job = client.submit_job(
        entrypoint=f"{sys.executable} -m jobs.serve {finished_run} --port {http_port} --model-id tiny",
        runtime_env={"working_dir": str(REPO), "excludes": ["runs", "*.egg-info"]},
    )
    status = _wait(client, job, 600)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert f"serving 'tiny' at http://127.0.0.1:{http_port}/v1" in logs and "'eagle3'" in logs

    # the app outlives the job that deployed it
    api = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
    assert [m.id for m in api.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "What is 12 plus 30?"}]
    out = api.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                      temperature=1.0, seed=0)
    assert out.choices[0].message.content and out.usage.completion_tokens == 24
    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                              temperature=0.0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 2 and text

    # vLLM's own counters: the engine proposed drafts for these requests
    drafts = {}
    deadline = time.time() + 60
    while time.time() < deadline and not drafts:
        drafts = {k: v for k, v in _scrape(metrics_port, "vllm_spec_decode_").items()
                  if k.startswith("vllm_spec_decode_num_drafts")}
        time.sleep(1)
    (lines,) = drafts.values()
    assert any('model_name="tiny"' in line and float(line.rsplit(" ", 1)[1]) > 0 for line in lines), lines
