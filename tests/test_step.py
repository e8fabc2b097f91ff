"""The RL loop's own code (``rl_step``, ``run_steps``, the ``Coordinator``,
``DraftClient``, the object-store weight sender) over in-process fakes of
the roles it talks to: replicas that return scripted rollouts, a policy
that does not train, and a DraftTrainer actor that answers at once. Runs in
seconds; what the real roles do is tested in test_faults.py, test_job_submit.py
and the notebooks."""

from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import ray
import torch

from rayspec.batch import RolloutBatch
from rayspec.config import load_config
from rayspec.draft.client import DraftClient, NullDraft
from rayspec.draft.trainer import TrainingCadence
from rayspec.metrics import MetricsLog, read_metrics
from rayspec.reward.pool import RewardError
from rayspec.rollout.client import LocalReplicas, RolloutClient
from rayspec.rollout.spec_stats import SpecStats
from rayspec.sync import ObjectStoreSender
from rayspec.train.coordinator import Coordinator
from rayspec.train.loop import resume as loop_resume
from rayspec.train.loop import run_steps, start_over
from rayspec.train.ranks import Ranks, RunAborted, report_aborts
from tests.conftest import STEP_RECORD_KEYS


class FakeTokenizer:
    def apply_chat_template(self, msgs, **kw):
        return {"input_ids": [ord(c) % 97 for c in msgs[-1]["content"][:12]]}


class FakeEngine:
    """A replica whose rollouts are scripted token lists, logging every call."""

    def __init__(self, calls: list):
        self.calls, self.policy_version, self.draft_version = calls, 0, 0
        self.replica_id = "fake-0"

    def generate(self, prompt_ids, n=1, temperature=1.0, top_p=1.0, max_tokens=8, group_offset=0, seed=None,
                 refits=None, draft_acceptance=None, rows=None):
        self.calls.append(("generate", self.policy_version, self.draft_version, draft_acceptance is not None))
        if rows is not None:
            return self._trajectories(prompt_ids, rows, n, group_offset)
        batch = RolloutBatch([], [], [], [], policy_version=self.policy_version)
        for i, p in enumerate(prompt_ids):
            for j in range(n):
                batch.prompt_ids.append(list(p))
                batch.response_ids.append([1, 2, 3][: 1 + (i + j) % 3])
                batch.rollout_logprobs.append([-0.5] * len(batch.response_ids[-1]))
                batch.group.append(group_offset + i)
                batch.texts.append("the answer is 0" if (group_offset + i + j) % 2 else "no idea")
                if self.policy_version >= 2 and j == 1:  # what a reward function in test_reward_errors fails on
                    batch.texts[-1] += " (late)"
        stats = SpecStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=2, accepted_per_pos=[2, 0, 0],
                          output_tokens=sum(map(len, batch.response_ids)), wall_s=0.01)
        stats.replicas = {self.replica_id: SpecStats(**{**stats.__dict__, "replicas": {}})}
        return batch, stats

    def _trajectories(self, prompt_ids, rows, n, group_offset):
        """Multi-turn samples: a call, a tool message (masked), the row's answer; an environment whose
        get_reward() is 0.5."""
        batch = RolloutBatch([], [], [], [], policy_version=self.policy_version)
        for i, (p, row) in enumerate(zip(prompt_ids, rows)):
            for _ in range(n):
                batch.prompt_ids.append(list(p))
                batch.response_ids.append([1, 2, 9, 9, 3])
                batch.loss_mask.append([1, 1, 0, 0, 1])
                batch.rollout_logprobs.append([-0.5, -0.5, 0.0, 0.0, -0.5])
                batch.group.append(group_offset + i)
                batch.texts.append(row["answer"])
                batch.completions.append([{"role": "assistant", "content": "<tool_call>..."},
                                          {"role": "tool", "name": "look", "content": "9"},
                                          {"role": "assistant", "content": row["answer"]}])
                batch.tool_counts.append({"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0,
                                          "malformed_calls": 0, "drafts_first_turn": 2, "accepted_first_turn": 1,
                                          "drafts_after_tool": 1, "accepted_after_tool": 2,
                                          "accepted_from_tool": 1})
                batch.environments.append(SimpleNamespace(get_reward=lambda: 0.5))
        return batch, SpecStats(output_tokens=3 * len(batch), wall_s=0.01, replicas={self.replica_id: SpecStats()})

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        return False

    def receive_refit(self, target, weights, version):
        weights = ray.get(weights)
        self.calls.append(("refit", target, version, sorted(weights)))
        setattr(self, f"{target}_version", version)
        return version

    def versions(self):
        return {"policy": self.policy_version, "draft": self.draft_version}

    def busy_intervals(self, since):
        return [(since, since + 0.001)]

    def node_and_gpu(self):
        return ("node", None)


class FakePolicy:
    """One rank's policy (``rayspec.train.policy.Policy``) that does not
    train: where the head trains, it hands the feature sink the output
    layer's rows the sink asks for and two micro-batches of features, and it
    reports what a DeepSpeed step would."""

    def __init__(self, calls: list):
        self.calls, self.ranks, self.version = calls, Ranks(), 0
        self.states: dict[int, dict] = {}  # rank 0's trainer state at each checkpoint, by step

    def restore(self, checkpoint, restore_draft=None):
        self.version = checkpoint.state["policy_version"]
        return checkpoint.state, None

    def share(self, rollout):
        return rollout.batch.shard(0, 1)

    def update(self, shard, features=None):
        self.calls.append(("update", len(shard), features is not None))
        if features is not None:  # as PolicyWorker.update: the verifier's output layer, then the features
            self.calls.append(("output_weights", features.rows.tolist()))
            features.start({"embed": torch.zeros(1)}, 2)
            for m in range(2):
                features.submit(ray.put({"chunk": torch.tensor([m])}), m)
        self.version += 1
        return {"loss": 0.25, "clip_frac": 0.0}

    def refit_weights(self):
        self.calls.append(("release",))  # HostGather: the device is given back before the refit
        return {"w": torch.full((2,), float(self.version))}

    def refit_sent(self):
        pass

    def checkpoint(self, metrics, trainer_state, stage_draft):
        self.calls.append(("checkpoint", metrics["step"], trainer_state["policy_version"], stage_draft is not None))
        self.states[metrics["step"]] = json.loads(json.dumps(trainer_state))  # as trainer_state.json holds it

    def report(self, metrics):
        self.calls.append(("report", metrics["step"]))


@ray.remote(num_cpus=0, max_concurrency=2)
class FakeDraftTrainer:
    """Trains once the step's features are in, one version per call."""

    def __init__(self):
        self.version, self.chunks, self.lock = 0, [], threading.Condition()
        self.start, self.restored = "first", None

    def incarnation(self):
        return self.start, self.restored is not None

    def restart(self):  # what Ray's restart leaves: a new start at the initial head
        self.version, self.start, self.restored = 0, f"{self.start}+", None

    def set_state(self, tensors, meta):
        self.version, self.restored = meta["version"], sorted(tensors)
        return self.version

    def set_version(self, version):
        self.version = version
        return version

    def submit_features(self, refs, indices):
        with self.lock:
            self.chunks += indices
            self.lock.notify_all()

    def train(self, verifier, steps, expect):
        t0 = time.time()
        with self.lock:
            assert self.lock.wait_for(lambda: len(self.chunks) >= expect, timeout=30)
            got, self.chunks = sorted(self.chunks), []
        self.version += 1
        return {"draft_version": self.version, "draft_loss": 1.0 / self.version, "time_s": 0.01,
                "start_time": t0, "end_time": time.time(), "chunks": got, "draft_top1_per_step": [0.5],
                "draft_acceptance_estimate": [0.3, 0.1, 0.0], "draft_acceptance_se": 0.05,
                "draft_acceptance_clusters": 4, "draft_acceptance_by_share": [[1.0, 16, [0.3, 0.1, 0.0]]]}

    def vllm_weights(self):
        return {"fc.weight": torch.full((1,), float(self.version))}

    def draft_ids(self):
        return torch.tensor([3, 5, 8])

    def reset(self):
        return 0

    def node_and_gpu(self):
        return ("node", None)


def test_the_fake_policy_and_the_policy_worker_are_the_policy_the_loop_uses():
    """``FakePolicy`` and ``PolicyWorker`` have every member of the loop's
    ``Policy`` protocol, its methods with the same parameters (names, kinds,
    defaults): the fake runs below call the step as it calls the real policy."""
    from rayspec.train.policy import Policy, PolicyWorker

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    methods = sorted(n for n, v in vars(Policy).items() if callable(v) and not n.startswith("_"))
    assert methods == ["checkpoint", "refit_sent", "refit_weights", "report", "restore", "share", "update"]
    worker = PolicyWorker(None, SimpleNamespace(trainer=SimpleNamespace(seed=0)), Ranks(), 0, torch.float32)
    for policy in (FakePolicy([]), worker):
        assert isinstance(policy, Policy)  # runtime_checkable: each member (ranks too) is there
        for name in methods:
            assert params(getattr(type(policy), name)) == params(getattr(Policy, name)), (type(policy), name)


def test_prompt_groups_go_as_request_units_spread_over_the_replicas():
    """For replicas that batch calls continuously (AsyncEngine), each
    prompt's group is one request unit (its samples together, seeded by its
    own index), spread over the replicas; the batch comes back in prompt
    order with every replica's stats summed. Otherwise: one shard per replica.
    Each unit carries the rollout's seed, which the replica's requests derive
    theirs from with their prompt's index (the group offset onward)."""
    units = []

    class Replica(FakeEngine):
        def generate(self, prompt_ids, group_offset=0, seed=None, **kw):
            units.append((self.replica_id, len(prompt_ids), group_offset, seed))
            return super().generate(prompt_ids, group_offset=group_offset, seed=seed, **kw)

    replicas = [Replica([]), Replica([])]
    replicas[1].replica_id = "fake-1"
    prompts = [[7], [8], [9]]
    batch, stats = RolloutClient(LocalReplicas(replicas), 2, by_group=True).generate(prompts, n=2, seed=5)
    assert sorted(u[1:] for u in units) == [(1, i, 5) for i in range(3)]
    assert {u[0] for u in units} == {"fake-0", "fake-1"}
    assert batch.group == [0, 0, 1, 1, 2, 2] and [p[0] for p in batch.prompt_ids] == [7, 7, 8, 8, 9, 9]
    assert stats.num_drafts == 12 and set(stats.replicas) == {"fake-0", "fake-1"}
    units.clear()
    RolloutClient(LocalReplicas(replicas), 2).generate(prompts, n=2, seed=5)
    assert sorted(u[1:] for u in units) == [(1, 2, 5), (2, 0, 5)]


def _run(tmp_path, draft_online: bool, steps: int = 3, overrides: tuple = (), records: list | None = None,
         resume: dict | None = None, states: dict | None = None):
    """A run over the fakes; ``resume``: a trainer state to continue from
    (``loop.resume``, as restarted Train workers do) instead of step 1;
    ``states`` gets the trainer state of each checkpoint."""
    cfg = load_config(None, [f"trainer.steps={steps}", f"trainer.run_dir={tmp_path}", "trainer.save_steps=2",
                             "trainer.eval_every=2", "data.eval_num_problems=4", "trainer.eval_samples=1",
                             "data.prompts_per_step=2", "grpo.group_size=2", "train.num_workers=1", *overrides])
    calls: list = []
    replicas = RolloutClient(LocalReplicas([FakeEngine(calls)]), 1)
    policy = FakePolicy(calls)
    actor = FakeDraftTrainer.remote() if draft_online else None
    draft = DraftClient(actor, Ranks(), [1, 2], 1, TrainingCadence(0, 0.0)) if draft_online else NullDraft()
    if draft_online:
        draft.connect()
    coord = Coordinator(cfg, FakeTokenizer(), replicas, ObjectStoreSender(replicas), lambda: draft.acceptance,
                        MetricsLog(tmp_path))
    try:
        if resume is None:
            start_over(policy, coord, draft)
        version = 0 if resume is None else \
            loop_resume(SimpleNamespace(path="checkpoint", state=resume), policy, coord, draft)
        run_steps(cfg, coord, policy, draft, version)
    finally:
        coord.close()
        if actor is not None:
            ray.kill(actor)
        if records is not None:
            records += read_metrics(tmp_path)
        if states is not None:
            states.update(policy.states)
    return cfg, calls, read_metrics(tmp_path)


def test_a_multi_turn_run_trains_on_trajectories_and_records_their_tools(ray_session, tmp_path):
    """With an environment, the rows reach the replicas, the reward is the
    functions' plus the environment's get_reward() (weight 1, TRL's rule),
    the policy trains on the masked trajectories, and the record carries
    the turns, the tool calls and the acceptance by turn."""
    env = tmp_path / "env.py"
    env.write_text("class Lookup:\n    def reset(self, **row):\n        pass\n\n"
                   "    def look(self, key: str) -> str:\n        \"\"\"Look.\n\n        Args:\n"
                   "            key: what.\n        \"\"\"\n        return key\n\n"
                   "    def get_reward(self) -> float:\n        return 0.5\n")
    seen = []
    _, calls, records = _run(tmp_path / "run", draft_online=False, steps=2,
                             overrides=(f"rollout.environment={env}:Lookup",), records=seen)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # the texts are the rows' answers: last_number scores them 1; Lookup.get_reward adds 0.5
        assert r["rewards"] == {"last_number": 1.0, "Lookup": 0.5} and r["reward_mean"] == 1.5
        assert r["turns_mean"] == 2 and r["tool_calls"] == 4 and r["tool_call_rate"] == 1.0
        assert r["tool_token_share"] == 0.4 and r["tool_errors"] == r["malformed_calls"] == 0
        assert r["acceptance_length_first_turn"] == 1.5 and r["acceptance_length_after_tool"] == 3.0
        assert r["tool_copied_tokens"] == 4
    assert ("update", 4, False) in calls


def test_steps_run_their_phases_in_order_with_the_draft_beside_the_policy(ray_session, tmp_path):
    cfg, calls, records = _run(tmp_path, draft_online=True)
    # evaluation of version 0, then per step: rollout, sleep (colocated), update with features,
    # the policy refit, the draft refit; evaluations of versions 2 and 3 after their refits
    kinds = [c[0] if c[0] != "refit" else f"refit {c[1]} v{c[2]}" for c in calls]
    step = ["generate", "sleep", "update", "release", "refit policy v{}", "refit draft v{}"]
    want = ["generate"] * 2 + [p.format(1) for p in step] + [p.format(2) for p in step] + ["generate"] * 2 + \
        ["checkpoint"] + [p.format(3) for p in step] + ["generate"] * 2 + ["checkpoint"]
    assert [k for k in kinds if k not in ("report", "output_weights")] == want
    # rank 0 takes of the output layer only the head's draft vocabulary's rows, each step it trains
    assert [c for c in calls if c[0] == "output_weights"] == [("output_weights", [3, 5, 8])] * 3
    assert ("report", 1) in calls and ("report", 3) not in calls  # step 3 (the last) checkpoints instead
    assert {c for c in calls if c[0] == "sleep"} == {("sleep", 2)}  # a policy refit ends each sleep
    # each rollout samples the newest policy and draft, and carries the draft's estimate from step 2 on
    rollouts = [c for c in calls if c[0] == "generate"]
    assert [c[1:] for c in rollouts if c[3]] == [(1, 1, True), (2, 2, True)]
    assert [r["policy_version"] for r in records] == [0, 1, 2] and [r["policy_lag"] for r in records] == [0] * 3
    assert [r["draft_version"] for r in records] == [1, 2, 3]
    assert [r["draft_trained"] for r in records] == [1, 1, 1] and all(r["draft_alive"] == 1 for r in records)
    assert [[e["policy_version"] for e in r.get("evals", [])] for r in records] == [[0], [2], [3]]
    for r in records:
        assert STEP_RECORD_KEYS <= r.keys()
        assert 0 <= r["reward_mean"] <= 1 and r["loss"] == 0.25 and r["draft_loss"] == 1.0 / r["draft_version"]
        assert r["acceptance_length"] == 1.5 and r["num_drafts"] == 4 and r["drafted_share"] > 0
        assert r["weight_sync_transport"] == "object_store" and r["weight_sync_bytes"] > 0
        assert 0 <= r["idle_draft_s"] <= r["time_step_s"] and 0 <= r["idle_rollout_s"] <= r["time_step_s"]
        assert r["draft_acceptance_estimate"] == [0.3, 0.1, 0.0]
        assert "overlong_penalty_mean" not in r
    checkpoints = [c for c in calls if c[0] == "checkpoint"]
    assert checkpoints == [("checkpoint", 2, 2, True), ("checkpoint", 3, 3, True)]


@pytest.mark.parametrize("lag", [1, 2])
def test_an_async_run_restarted_from_a_checkpoint_trains_each_step_once_on_the_same_prompts(ray_session, tmp_path,
                                                                                            lag):
    """Train workers restarted after a failure in step 4 of an async run
    (``max_policy_lag`` 1 and 2), from step 2's checkpoint: the failed
    attempt's batches generated ahead died with it. The restarted attempt
    trains steps 3-6 on the uninterrupted run's prompts, each step on one
    batch, within the lag bound (lag 0 at step 3: its batch is generated
    again with the restored policy), and its records say which batches the
    failed attempt had drawn; its record of step 3 is set aside, the node
    loss it held carried into the new step 3."""
    mode = ("scheduler.layout=split", "scheduler.mode=async", f"scheduler.max_policy_lag={lag}",
            "trainer.eval_every=0")
    states: dict = {}
    _, calls, want = _run(tmp_path / "whole", draft_online=False, steps=6, overrides=mode, states=states)
    # nothing is generated ahead for a step past the last: the run drew 6 batches
    assert sum(c[0] == "generate" for c in calls) == 6
    assert states[2]["steps"] == 6
    run_dir = tmp_path / "restarted"
    run_dir.mkdir()
    lines = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines(keepends=True)
    # the failed attempt had recorded step 3, and in it a node lost
    lost = {"nodes": ["0123abcd"], "lost": {"rollout": [0]}, "moved": {"rollout": ["4567ef01"]}}
    (run_dir / "metrics.jsonl").write_text("".join(lines[:2]) + json.dumps({**json.loads(lines[2]),
                                                                             "node_failures": [lost]}) + "\n")
    _, _, got = _run(run_dir, draft_online=False, steps=6, overrides=mode, resume=states[2])
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [r["problem_ids"] for r in got] == [r["problem_ids"] for r in want]
    assert all(len(r["response_lens"]) == 4 for r in got)  # one batch: 2 prompts x group_size 2
    for r in got:
        assert 0 <= r["policy_lag"] <= lag and r["policy_version"] == r["step"] - 1 - r["policy_lag"], r
    assert got[2]["policy_lag"] == 0
    # drawn by the failed attempt: steps 3 (recorded), 4 (in progress) and the lag after it
    assert [r["rollout_regenerated"] for r in got] == {1: [0, 0, 1, 1, 1, 0], 2: [0, 0, 1, 1, 1, 1]}[lag]
    discarded = [json.loads(line) for line in (run_dir / "metrics.discarded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in discarded] == [3]
    # the record set aside said a node was lost: the step that takes its place says it
    assert [r.get("node_failures") for r in got] == [None, None, [lost], None, None, None]


@pytest.mark.parametrize("mode", [(), ("scheduler.layout=split", "scheduler.mode=async")], ids=["sync", "async"])
def test_a_run_the_driver_stops_saves_the_last_step_it_finished(ray_session, tmp_path, monkeypatch, mode):
    """The driver stops the run in step 4 (a node died and the nodes left
    cannot hold the layout: it posts why, then deletes the rollout
    deployment, so the replicas' calls fail). Every rank ends with the
    driver's ClusterFitError, after a checkpoint of step 3 (the save
    interval's would have been step 2's) whose prompt cursor is before step
    4's batch (async: the batch generating ahead that failed): a resume
    from it trains steps 4-5 on the uninterrupted run's prompts."""
    from rayspec.scheduler.recovery import start_node_events

    overrides = (*mode, "trainer.eval_every=0")
    _, _, want = _run(tmp_path / "whole", draft_online=False, steps=5, overrides=overrides)
    events = start_node_events()
    reason = "role 'rollout' (1 x {'CPU': 0.5}) fits no node left. Waited 0 s for nodes to join"
    generate, batches = FakeEngine.generate, []

    def lost_at_batch_4(self, *args, **kw):
        batches.append(1)
        if len(batches) == 4:
            ray.get(events.stop.remote(reason))
            raise RuntimeError("Deployment(name='rollout') is unavailable")  # as Serve's, once deleted
        return generate(self, *args, **kw)

    monkeypatch.setattr(FakeEngine, "generate", lost_at_batch_4)
    states, records = {}, []
    try:
        with pytest.raises(RunAborted, match=r"^ClusterFitError: role 'rollout'") as e:
            _run(tmp_path / "stopped", draft_online=False, steps=5, overrides=overrides, states=states,
                 records=records)
    finally:
        ray.kill(events)
    assert e.value.kind == "ClusterFitError"
    assert [r["step"] for r in records] == [1, 2, 3] and sorted(states) == [2, 3]
    assert states[3]["step"] == states[3]["policy_version"] == 3
    monkeypatch.setattr(FakeEngine, "generate", generate)
    _, _, got = _run(tmp_path / "stopped", draft_online=False, steps=5, overrides=overrides, resume=states[3])
    assert [r["problem_ids"] for r in got] == [r["problem_ids"] for r in want]


def test_a_restarted_draft_trainer_rejoins_from_the_newest_checkpoint_with_a_draft_state(ray_session, tmp_path,
                                                                                          caplog):
    """Ray restarted the DraftTrainer (its head is the initial one again, its
    calls succeed): the next step's start sees the new incarnation, restores
    the newest checkpoint that holds a draft state, numbers the head past
    the replicas' version and sends it at the refit; the records count the
    restart and the updates lost. Once Ray gives up, the run goes on
    untrained, said once as an error."""
    from ray.train import Checkpoint

    from rayspec.draft.state import save_draft_state

    ckpts = [tmp_path / "checkpoint_1", tmp_path / "checkpoint_2", tmp_path / "checkpoint_3"]
    for d in ckpts:
        d.mkdir()
    save_draft_state(({"head.w": torch.ones(2)}, {"version": 2, "rng": [3, [1, 2], None]}), ckpts[0])
    (ckpts[2] / "draft.json").write_text('{"version": 3, "rng": [3, [1, 2], nu')  # cut off mid-write
    actor = FakeDraftTrainer.remote()
    draft = DraftClient(actor, Ranks(), [1, 2], 1, TrainingCadence(0, 0.0),
                        checkpoints=lambda: [Checkpoint(str(d)) for d in ckpts])
    draft.connect()
    draft.version = 3  # what the replicas hold: one update after checkpoint_1's
    rollout = SimpleNamespace(stats=SimpleNamespace(drafted_share=1.0))
    refits = []

    def refit():  # the step's end: the head its refit sends, if any
        step = draft.finish()
        if step.head is not None:
            refits.append(("draft", step.head.version))
        return step.fields

    try:
        assert draft.begin(rollout) and draft.restarts == 0  # the same start: nothing to do
        ray.get(actor.restart.remote())
        assert draft.begin(rollout)
        assert ray.get(actor.incarnation.remote()) == ("first+", True)
        assert (draft.version, draft.restarts, draft.versions_lost) == (4, 1, 1)
        refit()  # not trained this step: the restored head still goes out
        assert refits == [("draft", 4)]
        rec = refit()
        assert refits == [("draft", 4)]
        assert (rec["draft_alive"], rec["draft_restarts"], rec["draft_versions_lost"]) == (1, 1, 1)
        assert draft.state_dict()["draft_restarts"] == 1
        # restarted again right after a checkpoint of the head the replicas hold: nothing lost, nothing sent
        ckpts.append(tmp_path / "checkpoint_4")
        ckpts[-1].mkdir()
        save_draft_state(({"head.w": torch.ones(2)}, {"version": 4, "rng": [3, [1, 2], None]}), ckpts[-1])
        ray.get(actor.restart.remote())
        assert draft.begin(rollout)
        refit()
        assert (draft.version, draft.restarts, draft.versions_lost, refits) == (4, 2, 1, [("draft", 4)])
    finally:
        ray.kill(actor)
    with pytest.raises(ray.exceptions.RayActorError):  # ray.kill lands asynchronously
        for _ in range(100):
            ray.get(actor.incarnation.remote())
            time.sleep(0.1)
    with caplog.at_level(logging.ERROR, logger="rayspec.draft.client"):
        assert not draft.begin(rollout) and not draft.begin(rollout)
    said = [r.getMessage() for r in caplog.records if r.name == "rayspec.draft.client" and r.levelno >= logging.ERROR]
    assert len(said) == 1 and "NO LONGER TRAINED" in said[0]
    assert draft.finish().fields["draft_alive"] == 0


def test_without_online_training_the_step_is_the_same_minus_the_draft(ray_session, tmp_path):
    """Also with DAPO's overlong penalty on: responses of 1, 2, 2 and 3 tokens
    against a cap of 4 with a buffer of 2: only the 3-token one, half-way
    into the buffer, is penalised (-0.5)."""
    _, calls, records = _run(tmp_path, draft_online=False, steps=2, overrides=(
        "grpo.max_new_tokens=4", "grpo.overlong_buffer.enabled=true", "grpo.overlong_buffer.len=2"))
    assert [c for c in calls if c[0] in ("update", "refit")] == [
        ("update", 4, False), ("refit", "policy", 1, ["w"]), ("update", 4, False), ("refit", "policy", 2, ["w"])]
    for r in records:
        assert STEP_RECORD_KEYS <= r.keys()
        assert "draft_alive" not in r and "draft_trained" not in r and r["draft_version"] == 0
        assert r["time_draft_s"] == 0.0 and r["draft_acceptance_estimate"] == []
        assert r["overlong_penalty_mean"] == -0.125 and r["response_lens"] == [1, 2, 2, 3]


REWARDS = """
def fails_late(completions, **kwargs):
    if any("late" in c[-1]["content"] for c in completions):
        raise RuntimeError("late completion")
    return [0.5 for _ in completions]
"""


def test_a_reward_function_that_fails_stops_the_run_naming_it_and_keeps_what_was_written(ray_session, tmp_path):
    """Steps 1 and 2 score with a function of one's own (weighted with the
    built-in); step 3's rollout holds a completion it raises on: the run
    stops naming the function and the sample; steps 1-2's records and the
    step-2 checkpoint stay. With reward.on_error=zero the run goes on,
    counting the zeroed scores."""
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    functions = f"reward.functions=[{tmp_path}/my_rewards.py:fails_late,last_number]"
    records: list = []
    with pytest.raises(RunAborted, match=r"^RewardError: .*my_rewards.py:fails_late raised RuntimeError: late "
                                         r"completion on sample 1 of the batch \(row \d+ of arithmetic") as e:
        _run(tmp_path / "raise", draft_online=False, overrides=(functions, "reward.weights=[2.0,1.0]",
                                                               "trainer.eval_every=0"), records=records)
    assert isinstance(e.value.__cause__, RewardError)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rewards"]["fails_late"] == 0.5 and r["reward_errors"] == 0 for r in records)
    assert all(r["reward_mean"] == pytest.approx(1.0 + r["rewards"]["last_number"]) for r in records)
    _, calls, records = _run(tmp_path / "zero", draft_online=False, overrides=(
        functions, "reward.on_error=zero", "trainer.eval_every=0"))
    assert [r["reward_errors"] for r in records] == [0, 0, 2]  # the second sample of each of step 3's 2 groups
    assert ("checkpoint", 2, 2, False) in calls and records[2]["rewards"]["fails_late"] == 0.25


BY_ANSWER = """
def by_answer(completions, answer, **kwargs):
    # even answers: 1 for the scripted "the answer is 0", 0 for "no idea"; odd answers: 1 for both
    return [float("answer" in c[-1]["content"]) if int(a) % 2 == 0 else 1.0 for c, a in zip(completions, answer)]
"""


@pytest.mark.parametrize("mode", [(), ("scheduler.layout=split", "scheduler.mode=async")], ids=["sync", "async"])
def test_dynamic_sampling_drops_equal_reward_groups_and_refills_them_from_new_prompts(ray_session, tmp_path, mode):
    """DAPO's dynamic sampling over the scripted replica: a group scores
    [1, 0] where its answer is even and [1, 1] (dropped) where it is odd.
    The expected draws are replayed from the same prompt source: each step
    takes rounds of 2 prompts until 2 even-answer groups are in hand (at
    most 3 rounds, then odd ones fill the batch). In async mode the refills
    are batches generated ahead, by a newer policy than the step's first
    batch: the joined batch counts as the oldest (its policy lag)."""
    from rayspec.data import PromptSource, train_and_heldout

    (tmp_path / "r.py").write_text(BY_ANSWER)
    cfg, calls, records = _run(tmp_path / "run", draft_online=False, steps=4, overrides=(
        f"reward.functions=[{tmp_path}/r.py:by_answer]", "grpo.dynamic_sampling=true", "trainer.eval_every=0",
        *mode))
    source = PromptSource(train_and_heldout(cfg.data, 0)[0], 2, cfg.data.seed)
    for r in records:
        kept, dropped, rounds = [], [], 0
        while len(kept) < 2 and rounds < 3:
            rounds += 1
            for p in source.next_batch():
                (kept if int(p.columns["answer"]) % 2 == 0 else dropped).append(p)
        trained = (kept + dropped)[:2]
        assert r["problem_ids"] == [p.index for p in trained], r["step"]
        assert r["sampling_rounds"] == rounds and r["groups_dropped"] == len(dropped) - max(0, 2 - len(kept))
        assert r["reward_mean"] == sum(0.5 if int(p.columns["answer"]) % 2 == 0 else 1.0 for p in trained) / 2
        assert len(r["response_lens"]) == 4  # prompts_per_step * group_size, whatever the rounds
    generated = [c[1] for c in calls if c[0] == "generate"]
    assert len(generated) - sum(r["sampling_rounds"] for r in records) in ({0} if not mode else {0, 1})
    assert any(r["sampling_rounds"] > 1 for r in records), "the seeded prompts never needed a refill"
    for r in records:  # the step's first batch is the oldest it trains on
        assert 0 <= r["policy_lag"] <= (1 if mode else 0) and r["policy_version"] == r["step"] - 1 - r["policy_lag"]
    if mode:  # a batch generated ahead at lag 1, refilled from one sampled by the next version
        assert any(r["sampling_rounds"] > 1 and r["policy_lag"] == 1 for r in records)


def test_an_acceptance_collapse_on_one_replica_is_reported_only_with_an_unchanged_head():
    from rayspec.rollout.spec_stats import AcceptanceWatch, SpecStats

    def stats(rates: dict[str, float]) -> SpecStats:
        return SpecStats(replicas={r: SpecStats(num_drafts=100, accepted_per_pos=[int(100 * p), 0])
                                   for r, p in rates.items()})

    watch = AcceptanceWatch(fraction=0.5, window=5, patience=2)
    for _ in range(3):
        assert watch.observe(stats({"a": 0.6, "b": 0.6}), draft_version=1) == []
    # b drops to 0.1 (the head it should hold gives 0.6): the second step in a row is reported
    assert watch.observe(stats({"a": 0.6, "b": 0.1}), draft_version=1) == []
    [c] = watch.observe(stats({"a": 0.6, "b": 0.1}), draft_version=1)
    assert (c["replica"], c["rate"], c["median"], c["steps"]) == ("b", 0.1, 0.6, 2)
    # a new head explains a drop: the count starts again
    assert watch.observe(stats({"a": 0.6, "b": 0.1}), draft_version=2) == []
    # a replica that drafted nothing (adaptive k idle) is not a collapse
    assert watch.observe(SpecStats(replicas={"a": SpecStats(), "b": SpecStats()}), draft_version=2) == []


def test_a_bad_input_on_rank_0_stops_every_train_worker_once_without_a_restart(ray_session, tmp_path):
    """Rank 0 meets a RewardError inside ``stop_on``: both ranks of a real
    Ray Train worker group (gloo) agree and end without a failure
    (``report_aborts``), so Ray Train does not restart them (max_failures
    1: one attempt per rank), and the result's return value is the message
    the driver raises."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def aborting_loop(config):  # defined here: Ray pickles it by value (tests/ is not importable by workers)
        import os

        import ray.train

        from rayspec.reward.pool import RewardError
        from rayspec.train.ranks import Ranks

        ranks = Ranks(ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size())
        with open(os.path.join(config["dir"], f"attempts.{ranks.rank}"), "a") as f:
            f.write("x")
        for step in (1, 2):  # rank 0 meets a bad input at the second step
            with ranks.stop_on((RewardError,)):
                if ranks.is_driver and step == 2:
                    raise RewardError("reward function f raised ValueError: bad row")
            ray.train.report({"step": step})

    trainer = TorchTrainer(report_aborts(aborting_loop), train_loop_config={"dir": str(tmp_path)},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(name="abort", storage_path=str(tmp_path / "train"),
                                                failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    assert result.return_value == "RewardError: reward function f raised ValueError: bad row"
    assert [(tmp_path / f"attempts.{r}").read_text() for r in (0, 1)] == ["x", "x"]
