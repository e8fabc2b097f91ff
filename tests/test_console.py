"""The driver's console: a progress bar over the RL steps with each step
line and evaluation above it, and the warnings of rayspec's code in the
roles' processes relayed to it while Ray keeps their output in its logs."""

from __future__ import annotations

import io
import logging
import time

import pytest

from rayspec.console import Console
from rayspec.relay import relay_warnings, start_console_relay


def _record(step: int, **kw) -> dict:
    return {"step": step, "reward_mean": 0.5, "acceptance_length": 1.5, "acceptance_rate_per_pos": [0.5],
            "rollout_tokens_per_s": 10.0, "time_rollout_s": 1.0, "time_policy_s": 2.0, "time_draft_s": 0.5,
            "time_sync_s": 0.1, "policy_version": step - 1, "time_step_s": 3.25, **kw}


def test_the_console_prints_each_step_and_evaluation_above_a_bar_over_the_steps():
    out = io.StringIO()
    console = Console(4, done=1, file=out)  # a resumed run: step 1 was done before
    ev = {"policy_version": 1, "num_problems": 8, "temperature": 1.0, "reward_greedy": 0.25,
          "reward_sampled": 0.125, "greedy_changed": 0.5, "acceptance_length": 1.75, "time_s": 2.0}
    console.log(_record(2, evals=[ev]))
    console.log(_record(3))
    console.log(_record(3))  # step 3 run again after a failure: printed again, counted once
    assert console.bar.n == 3
    console.finish({})
    text = out.getvalue()
    assert ("eval v1 (8 held-out problems): reward greedy 0.250, T=1.0 0.125 | greedy changed 0.50 | "
            "accept_len 1.75 | 2.0s") in text
    assert text.index("eval v1") < text.index("step    2 |") < text.index("step    3 |")
    assert "RL steps: 3/4" in text and "last step 3.2s" in text
    quiet = io.StringIO()
    c = Console(2, lines=False, file=quiet)  # logging.verbose: rank 0's own lines are streamed
    c.log(_record(1))
    c.finish({})
    assert "step    1 |" not in quiet.getvalue() and "RL steps: 1/2" in quiet.getvalue()


@pytest.mark.usefixtures("ray_session")
def test_a_roles_warnings_reach_the_drivers_console_and_its_info_does_not():
    import ray

    @ray.remote(num_cpus=0)
    class Role:
        def __init__(self):
            relay_warnings()
            relay_warnings()  # once per process

        def say(self):
            log = logging.getLogger("rayspec.rollout.client")
            log.info("a replica is ready")
            log.warning("rollout replica died generating prompts 0..3; retrying the shard (1/2)")
            return len([h for h in logging.getLogger("rayspec").handlers if type(h).__name__ == "RelayHandler"])

    relay = start_console_relay()
    out = io.StringIO()
    console = Console(1, relay=relay, file=out)
    role = Role.remote()
    assert ray.get(role.say.remote()) == 1
    deadline = time.monotonic() + 30
    while "retrying the shard" not in out.getvalue() and time.monotonic() < deadline:
        console.tick()
        time.sleep(0.2)
    text = out.getvalue()
    assert "WARNING rayspec.rollout.client: rollout replica died generating prompts 0..3" in text
    assert f"on node {ray.get_runtime_context().get_node_id()[:8]})" in text and "a replica is ready" not in text
    console.finish({})
    ray.kill(role)
    # the driver's own process never relays (its records print here directly)
    relay_warnings()
    assert not any(type(h).__name__ == "RelayHandler" for h in logging.getLogger("rayspec").handlers)


def test_the_run_directory_links_to_rays_logs_of_the_drivers_node(tmp_path, caplog):
    from rayspec.driver import link_ray_logs

    run_dir, old, new = tmp_path / "run", tmp_path / "session_1" / "logs", tmp_path / "session_2" / "logs"
    for d in (run_dir, old, new):
        d.mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="rayspec.driver"):
        link_ray_logs(run_dir, old, verbose=False)
        link_ray_logs(run_dir, new, verbose=False)  # resumed in a new Ray session
    assert (run_dir / "ray_logs").resolve() == new.resolve()
    assert f"{run_dir / 'ray_logs'} -> {new} on this node" in caplog.text and "logging.verbose=true" in caplog.text
    (run_dir / "ray_logs").unlink()
    (run_dir / "ray_logs").mkdir()  # not ours: left alone
    (run_dir / "ray_logs" / "mine.txt").write_text("x")
    link_ray_logs(run_dir, new, verbose=True)
    assert (run_dir / "ray_logs" / "mine.txt").read_text() == "x"
