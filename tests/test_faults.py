"""Checkpoints, resume and failure injection on a real run (embedded Ray
cluster, a Serve replica with vLLM + EAGLE-3, two Ray Train workers with
DeepSpeed ZeRO-2, the DraftTrainer), each compared with an uninterrupted run.
The colocated runs refit through the cuda_ipc transport's CPU twin (rank 0's
export in shared memory, opened by the replica).

Each request samples with its own seed (per step, prompt and sample). With
the engine core in the replica's process this CPU engine then computes
bit-identical logprobs across engine instances too, so the resume test
compares samples, losses and draft losses as equal. The fault test compares
what must be equal whatever the engine computes: steps, prompts, samples
per prompt.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray

from jobs.grpo import main as grpo_main
from rayspec.config import ConfigError, load_config
from rayspec.draft.client import DRAFT_TRAINER_NAME
from rayspec.driver import run
from rayspec.train.checkpoint import checkpoints
from tests.conftest import IN_PROCESS
from tests.fault_engine import KILL_FILE_ENV, DyingEngine, arm, killed

STEPS = 4


def _cfg(tiny, run_dir, steps=STEPS, *more):
    return load_config(None, [f"model.path={tiny}", "model.dtype=float32", f"trainer.steps={steps}",
                              f"trainer.run_dir={run_dir}", "trainer.save_steps=2",
                              "trainer.max_failures=1", "grpo.max_new_tokens=24",
                              "data.prompts_per_step=2", "draft.steps_per_rl_step=2",
                              "rollout.weight_sync.transport=cuda_ipc", *IN_PROCESS, *more])



def _records(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _same_prompts(got, want):
    """One record per step, each step trained on the same prompts with
    group_size samples each (no prompt lost, repeated or duplicated)."""
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert g["problem_ids"] == w["problem_ids"], g["step"]
        assert len(g["response_lens"]) == 4 * len(g["problem_ids"]), g["step"]
        assert g["policy_version"] == w["policy_version"] == g["step"] - 1


def _same_samples(got, want):
    """Steps, prompts, responses and rewards of two runs agree step by step."""
    _same_prompts(got, want)
    for g, w in zip(got, want):
        assert g["response_lens"] == w["response_lens"], g["step"]
        assert g["reward_mean"] == w["reward_mean"], g["step"]
        assert g["sample"] == w["sample"], g["step"]
        # the same update: the policy's probabilities of the samples (restored
        # weights and optimizer) and the loss
        for key in ("loss", "ratio_mean", "token_mult_prob_error"):
            assert g[key] == w[key], (g["step"], key)


@pytest.fixture(scope="module")
def uninterrupted_dir(ray_session, tiny_llama_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faults") / "uninterrupted"
    run(_cfg(tiny_llama_dir, run_dir))
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_dir):
    return _records(uninterrupted_dir)


def _stopped_after_step_2(src, dst):
    """A copy of a finished 4-step run as a run stopped while step 4's
    checkpoint was written leaves it: Ray Train has registered step 2's
    checkpoint only, metrics.jsonl already holds steps 3 and 4, and
    ``draft_head/`` holds a head newer than the checkpoint's. Ray Train's
    snapshot (checkpoint_manager_snapshot.json, Ray 2.60) names checkpoints
    relative to its storage path, so the copy resumes from its own; it is
    rolled back to what it held after step 2's report."""
    shutil.copytree(src, dst)
    train = dst / "ray_train" / "train"
    snapshot = train / "checkpoint_manager_snapshot.json"
    state = json.loads(snapshot.read_text())
    step2, step4 = state["checkpoint_results"]
    assert step4["metrics"]["step"] == STEPS and state["latest_checkpoint_result"] == step4
    shutil.rmtree(train / step4["checkpoint_dir_name"])
    state.update(checkpoint_results=[step2], latest_checkpoint_result=step2,
                 checkpoint_report_indices=state["checkpoint_report_indices"][:1],
                 current_report_index=state["checkpoint_report_indices"][0] + 1)
    snapshot.write_text(json.dumps(state))


@pytest.mark.slow
def test_resume_continues_as_if_never_stopped(uninterrupted_dir, uninterrupted, tiny_llama_dir, s3_uri,
                                              tmp_path):
    """A run stopped after step 2's checkpoint, then ``jobs.grpo
    resume=<dir> trainer.steps=4``: steps 3-4 consume the prompts the
    uninterrupted run did, draw its samples and compute its losses, the
    DraftTrainer's included; the stopped attempt's records of steps 3-4 are
    set aside. Its checkpoints are moved to S3 (a moto server) first and the
    resume names them with ``trainer.storage_path``: Ray Train's workers
    restore from there and write the next ones there, nothing under
    ``<run_dir>/ray_train``."""
    import pyarrow.fs

    from rayspec.train.checkpoint import read_trainer_state

    run_dir = tmp_path / "resumed"
    _stopped_after_step_2(uninterrupted_dir, run_dir)
    (ckpt,) = [Path(c.path) for c in checkpoints(str(run_dir / "ray_train"))]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["policy_version"] == 2
    assert set(state["draft_cadence"]) == {"learning", "idle_steps", "last", "last_se", "last_clusters", "spacing"}
    assert {"rng_rank0.json", "rng_rank1.json", "trainer_state.json", "draft.safetensors",
            "draft.json", "policy"} <= \
        {p.name for p in ckpt.iterdir()}
    assert sorted(p.name for p in (ckpt / "policy" / "policy").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    storage = s3_uri("resumed")
    fs, root = pyarrow.fs.FileSystem.from_uri(storage)
    pyarrow.fs.copy_files(str(run_dir / "ray_train"), root, source_filesystem=pyarrow.fs.LocalFileSystem(),
                          destination_filesystem=fs)
    shutil.rmtree(run_dir / "ray_train")
    # a new run never silently continues (or overwrites) an old one
    with pytest.raises(ConfigError, match="resume="):
        run(_cfg(tiny_llama_dir, run_dir, STEPS, f"trainer.storage_path={storage}"))
    assert grpo_main([f"resume={run_dir}", f"trainer.steps={STEPS}", f"trainer.storage_path={storage}"]) == 0
    got = _records(run_dir)
    _same_samples(got, uninterrupted)
    discarded = [json.loads(line) for line in (run_dir / "metrics.discarded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in discarded] == [3, 4]
    assert [r["rollout_regenerated"] for r in got] == [0, 0, 1, 1]  # drawn by the stopped attempt too
    # the DraftTrainer resumed with its head, optimizer and replay buffer
    for key in ("draft_version", "draft_loss", "num_accepted_tokens"):
        assert [r[key] for r in got] == [r[key] for r in uninterrupted], key
    # the last two checkpoints are kept (trainer.num_to_keep), on S3
    assert [read_trainer_state(c)["step"] for c in checkpoints(storage)] == [2, 4]
    assert not (run_dir / "ray_train").exists()


def _actor_pid(class_part: str) -> int:
    """pid of a live actor of this test's Ray cluster whose class name
    contains class_part, read from the worker's process title
    ("ray::Class.method"). Not the state API: on a loaded 2-core CI machine
    one list_actors call outlasted the rest of the run."""
    return _actor_pids(class_part)[0]


def _actor_pids(class_part: str) -> list[int]:
    """Every live actor's pid of ``_actor_pid``'s kind."""
    # the embedded cluster's raylet, and so every worker, descends from this process;
    # as_dict reads a process that exits meanwhile as None instead of raising
    procs = [p.as_dict(["pid", "ppid", "cmdline"]) for p in psutil.Process().children(recursive=True)]
    actors = {d["pid"]: d["ppid"] for d in procs
              if d["cmdline"] and d["cmdline"][0].startswith("ray::") and class_part in d["cmdline"][0]}
    # a process the actor forked inherits its title: take the actor itself
    pids = [pid for pid, ppid in actors.items() if ppid not in actors]
    assert pids, f"no live actor of class *{class_part}*"
    return pids


def _kill(pid: int) -> None:
    """SIGKILL a process and its children (a replica's vLLM engine core)."""
    proc = psutil.Process(pid)
    for p in [*proc.children(recursive=True), proc]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)


def _dying(tmp_path):
    """Overrides for replicas of ``tests.fault_engine.DyingEngine``, which
    die on ``fault_engine.arm(trigger, n)``, and the trigger's path."""
    trigger = tmp_path / "kill-replica"
    return [f"rollout.engine_cls=tests.fault_engine:{DyingEngine.__name__}",
            f"rollout.engine_env.{KILL_FILE_ENV}={trigger}"], trigger


def _registered(run_dir) -> int:
    """Checkpoints Ray Train has registered (all ranks reported)."""
    snapshot = run_dir / "ray_train" / "train" / "checkpoint_manager_snapshot.json"
    return len(json.loads(snapshot.read_text())["checkpoint_results"]) if snapshot.is_file() else 0


def _wait(cond, timeout_s=600):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout_s:
            raise TimeoutError
        time.sleep(0.05)


@pytest.mark.slow
def test_run_survives_replica_train_worker_and_draft_trainer_failures(uninterrupted, tiny_llama_dir,
                                                                     tmp_path, monkeypatch):
    """One run, three faults: the rollout replica killed mid-generation at
    step 2 (its shard is retried on the replica Serve starts in its place,
    which first catches up on the weights), a Train worker killed at step 3
    (Ray Train restarts the worker group from the step-2 checkpoint), the
    DraftTrainer killed after step 3 (Ray restarts it; step 4 restores it
    from the step-2 checkpoint).
    Nothing is lost: every step's prompts, samples and rewards are the
    uninterrupted run's."""
    run_dir = tmp_path / "faults"
    dying, trigger = _dying(tmp_path)
    cfg = _cfg(tiny_llama_dir, run_dir, STEPS, *dying)
    injected: list[str] = []
    errors: list[BaseException] = []

    def inject():
        try:
            _inject()
        except BaseException as e:  # e.g. the state API timing out on a stale ray_current_cluster
            errors.append(e)
            raise

    def _inject():
        _wait(lambda: len(_records(run_dir)) >= 1)
        arm(trigger, cfg.grpo.group_size)  # step 2's rollout, which starts as step 1's record is written
        _wait(lambda: killed(trigger))
        injected.append("replica")
        # looked up before step 3 starts, so that the kill lands in it
        train_worker = _actor_pid("RayTrainWorker")
        _wait(lambda: _registered(run_dir) >= 1)  # step 2's checkpoint; step 3 is running
        assert len(_records(run_dir)) == 2, "step 3 ended before the Train worker could be killed"
        _kill(train_worker)
        injected.append("train worker")
        _wait(lambda: len(_records(run_dir)) >= 3)
        _kill(_actor_pid("DraftTrainer"))
        injected.append("draft trainer")

    # Ray Train's controller registers a checkpoint when it next polls the
    # workers (every 2 s by default, longer than a step here): poll faster, so
    # step 2's checkpoint is registered while step 3 runs (the driver passes
    # this variable on to the controller)
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    thread = threading.Thread(target=inject, daemon=True)
    thread.start()
    run(cfg)
    thread.join(timeout=5)
    assert not thread.is_alive(), f"the run ended before fault injection could (done: {injected})"
    assert not errors, f"fault injection failed after {injected}: {errors[0]!r}"
    assert injected == ["replica", "train worker", "draft trainer"]
    got = _records(run_dir)
    _same_prompts(got, uninterrupted)
    assert {r["weight_sync_transport"] for r in got} == {"cuda_ipc"}
    # the killed rank 0's exports went with it (torch's shm manager unlinks a dead client's files)
    assert not [p for p in Path("/dev/shm").glob("torch_*") if not psutil.pid_exists(int(p.name.split("_")[1]))]
    assert [r["rollout_retries"] for r in got] == [0, 1, 0, 0]
    assert [r["rollout_regenerated"] for r in got] == [0, 0, 1, 0]  # step 3's batch died with rank 0
    # Ray restarted the DraftTrainer after step 3: step 4 restored it from step 2's checkpoint
    # (version 3's update lost), numbered it 4 and trained it to 5
    assert [r["draft_alive"] for r in got] == [1, 1, 1, 1]
    assert [r["draft_version"] for r in got] == [1, 2, 3, 5]
    assert [(r["draft_restarts"], r["draft_versions_lost"]) for r in got] == [(0, 0)] * 3 + [(1, 1)]
    last = Path(checkpoints(str(run_dir / "ray_train"))[-1].path)
    assert json.loads((last / "trainer_state.json").read_text())["step"] == STEPS
    assert json.loads((last / "draft.json").read_text())["version"] == 5
    assert (run_dir / "draft_head").is_dir()  # the restart was taken over: its head is the final one


def test_workers_started_after_the_draft_trainer_died_go_on_without_it(ray_session):
    """A Train worker group (re)started after the DraftTrainer died gets no
    handle, and its draft client records the draft as gone, instead of the
    workers failing on the name lookup (what CI once hit when the DraftTrainer
    was killed while the workers restarted)."""
    from rayspec.draft.client import find_draft_trainer
    from rayspec.train.ranks import Ranks

    @ray.remote(num_cpus=0)
    class Stand:  # any actor registered under the DraftTrainer's name
        pass

    assert find_draft_trainer(Ranks(), online=False) == (None, False)
    stand = Stand.options(name=DRAFT_TRAINER_NAME).remote()
    handle, lost = find_draft_trainer(Ranks(), online=True)
    assert handle._actor_id == stand._actor_id and not lost
    ray.kill(stand)

    def gone():
        with contextlib.suppress(ValueError):
            ray.get_actor(DRAFT_TRAINER_NAME)
            return False
        return True

    _wait(gone, timeout_s=30)
    assert find_draft_trainer(Ranks(), online=True) == (None, True)


def test_restart_before_the_first_checkpoint_resets_the_draft_head(ray_session, head_dir):
    """Train workers restarted with no checkpoint start over from step 1
    (``start_over``): where the first attempt trained the head (the
    DraftTrainer's version) or the replicas hold a later policy or draft,
    the DraftTrainer goes back to its initial head, fresh AdamW state and
    version 0, and the replicas get policy version 0 and that head; a
    fresh start sends nothing."""
    import torch
    from types import SimpleNamespace

    from rayspec.draft.client import DraftClient
    from rayspec.draft.eagle3 import load_head, vllm_state_dict
    from rayspec.draft.trainer import DraftTrainer, TrainingCadence
    from rayspec.train import loop
    from rayspec.train.ranks import Ranks

    initial = vllm_state_dict(load_head(head_dir))
    actor = ray.remote(DraftTrainer).options(num_cpus=0).remote(str(head_dir), 1e-3, 1)
    draft = DraftClient(actor, Ranks(), [1, 2, 3], 1, TrainingCadence(0, 0.0))
    held = [{"policy": 0, "draft": 0}]
    refits = []

    def refit(version, weights, head=None):  # as the Coordinator sends them: the policy, then the head
        refits.append(("policy", weights, version))
        if head is not None:
            refits.append(("draft", head.weights, head.version))

    coord = SimpleNamespace(discard_after=lambda step: 0, replica_versions=lambda: held,
                            refit=refit, wait_refits=lambda: None, evaluate=lambda version: None)
    weights = {"w": torch.ones(2)}
    policy = SimpleNamespace(ranks=Ranks(), refit_weights=lambda: weights, refit_sent=lambda: None)

    def trained_elsewhere(version):  # the first attempt's head: other weights, a later version
        tensors, meta = ray.get(actor.get_state.remote())
        ray.get(actor.set_state.remote({k: v + 1 if k.startswith("head.") else v for k, v in tensors.items()},
                                       {**meta, "version": version}))

    try:
        loop.start_over(policy, coord, draft)  # a fresh start
        assert refits == []
        for replicas, trainer in (({"policy": 2, "draft": 2}, 2), ({"policy": 0, "draft": 0}, 1),
                                  ({"policy": 1, "draft": 0}, 0)):
            held[:] = [replicas]
            if trainer:
                trained_elsewhere(trainer)
            refits.clear()
            loop.start_over(policy, coord, draft)
            assert [(t, v) for t, _, v in refits] == [("policy", 0), ("draft", 0)], replicas
            assert refits[0][1] is weights
            sent = refits[1][1]
            assert sent.keys() == initial.keys() and all(torch.equal(sent[k], initial[k]) for k in initial)
            assert ray.get(actor.get_state.remote())[1]["version"] == 0
    finally:
        ray.kill(actor)


def test_draft_state_is_staged_by_the_draft_trainer_on_its_node(ray_session, head_dir, tmp_path, monkeypatch):
    """A checkpoint's draft state is written by the DraftTrainer itself where
    it shares rank 0's node (every shared-memory page the object store
    touches stays allocated to the end of the run), and comes through the
    object store from another node: the same files either way, and each
    restores into a fresh DraftTrainer by the same route."""
    import torch
    from safetensors.torch import load_file

    from rayspec.draft.trainer import DraftTrainer
    from rayspec.draft import state as draft_state

    trained, fresh = (ray.remote(DraftTrainer).options(num_cpus=0).remote(str(head_dir), 1e-3, 1)
                      for _ in range(2))
    try:
        tensors, meta = ray.get(trained.get_state.remote())
        changed = {k: v + 1 if k.startswith("head.") and v.is_floating_point() else v for k, v in tensors.items()}
        ray.get(trained.set_state.remote(changed, {**meta, "version": 5}))
        by_file, by_store = tmp_path / "file", tmp_path / "store"
        by_file.mkdir()
        by_store.mkdir()
        assert draft_state.stage_draft_state(trained, by_file) == "file"
        with monkeypatch.context() as m:
            m.setattr(draft_state, "_same_node", lambda actor: False)  # the actor on another node
            assert draft_state.stage_draft_state(trained, by_store) == "object_store"
            assert draft_state.restore_draft_state(fresh, by_store) == 5
        written = [load_file(str(d / "draft.safetensors")) for d in (by_file, by_store)]
        assert written[0].keys() == written[1].keys() == changed.keys()
        assert all(torch.equal(written[0][k], written[1][k]) for k in changed)
        assert (by_file / "draft.json").read_text() == (by_store / "draft.json").read_text()
        assert ray.get(fresh.get_state.remote())[0]["head.fc.weight"].equal(changed["head.fc.weight"])
        ray.get(fresh.reset.remote())
        assert draft_state.restore_draft_state(fresh, by_file) == 5
        restored = ray.get(fresh.get_state.remote())[0]
        assert all(torch.equal(restored[k], changed[k]) for k in changed if k.startswith("head."))
    finally:
        ray.kill(trained)
        ray.kill(fresh)


def test_a_checkpoint_whose_writer_is_killed_mid_copy_is_never_read(tmp_path):
    """Ray Train copies a checkpoint into the run directory, then registers
    it. A writer SIGKILLed mid-copy leaves a partial directory; only the
    registered one is listed (so resume and a restarted DraftTrainer read
    it), and it loads."""
    import signal
    import subprocess
    import sys

    import torch

    from rayspec.draft.state import load_draft_state, save_draft_state

    root = tmp_path / "ray_train" / "train"
    done = root / "checkpoint_2026-01-01_00-00-01"
    done.mkdir(parents=True)
    (done / "trainer_state.json").write_text(json.dumps({"step": 2}))
    save_draft_state(({"head.w": torch.arange(1 << 20, dtype=torch.float32)}, {"version": 2, "rng": [3, [1], None]}),
                     done)
    (root / "checkpoint_manager_snapshot.json").write_text(
        json.dumps({"checkpoint_results": [{"checkpoint_dir_name": done.name}]}))
    partial = root / "checkpoint_2026-01-01_00-00-09"
    # the writer: the same files, 64 KiB at a time, slowly; it says when it is inside draft.safetensors
    writer = subprocess.Popen([sys.executable, "-c", f"""
import pathlib, sys, time
src, dst = pathlib.Path({str(done)!r}), pathlib.Path({str(partial)!r})
dst.mkdir()
for f in sorted(src.iterdir(), key=lambda f: f.suffix != ".json"):
    data = f.read_bytes()
    with open(dst / f.name, "wb") as out:
        for i in range(0, len(data), 1 << 16):
            out.write(data[i:i + (1 << 16)]); out.flush()
            if f.suffix == ".safetensors" and i == 1 << 17:
                print("inside", flush=True)
            time.sleep(0.01)
"""], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "inside"
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    assert (partial / "draft.json").is_file()  # killed mid-write, its JSON already there
    assert (partial / "draft.safetensors").stat().st_size < (done / "draft.safetensors").stat().st_size
    assert [c.path for c in checkpoints(str(tmp_path / "ray_train"))] == [str(done)]
    tensors, meta = load_draft_state(Path(checkpoints(str(tmp_path / "ray_train"))[-1].path))
    assert meta["version"] == 2 and torch.equal(tensors["head.w"], torch.arange(1 << 20, dtype=torch.float32))
    (root / "checkpoint_manager_snapshot.json").write_text('{"checkpoint_results": [')  # half-written
    with pytest.raises(ValueError, match="checkpoint_manager_snapshot.json"):
        checkpoints(str(tmp_path / "ray_train"))


def test_checkpoints_on_s3_are_listed_and_read_without_the_policy(s3_uri, tmp_path, tiny_llama_dir):
    """``trainer.storage_path`` as an S3 URI (a moto server): the run's
    checkpoints are listed there (registered ones only) and read through
    pyarrow: the trainer state, and a checkpoint's draft files alone
    (a restarted DraftTrainer's restore), not its policy shards. A new run
    is refused on storage that holds a run's checkpoints, a URI no
    filesystem takes is refused before anything starts, both naming the key."""
    import pyarrow.fs
    import torch

    from rayspec.draft.state import DRAFT_FILES, load_draft_state, save_draft_state
    from rayspec.files import checkpoint_files
    from rayspec.preflight import check_resume
    from rayspec.train.checkpoint import read_trainer_state

    local = tmp_path / "train"
    for name, step in (("checkpoint_2026-01-01_00-00-01", 2), ("checkpoint_2026-01-01_00-00-09", 4)):
        (local / name / "policy").mkdir(parents=True)
        (local / name / "policy" / "shard.pt").write_bytes(b"\0" * (1 << 20))
        (local / name / "trainer_state.json").write_text(json.dumps({"step": step}))
        save_draft_state(({"head.w": torch.full((4,), float(step))}, {"version": step, "rng": [3, [1], None]}),
                         local / name)
    (local / "checkpoint_manager_snapshot.json").write_text(  # the step-4 copy is not registered yet
        json.dumps({"checkpoint_results": [{"checkpoint_dir_name": "checkpoint_2026-01-01_00-00-01"}]}))
    uri = s3_uri("runs/a")
    fs, root = pyarrow.fs.FileSystem.from_uri(uri)
    pyarrow.fs.copy_files(str(local), f"{root}/train", source_filesystem=pyarrow.fs.LocalFileSystem(),
                          destination_filesystem=fs)

    (ckpt,) = checkpoints(uri)
    assert isinstance(ckpt.filesystem, pyarrow.fs.S3FileSystem)
    assert ckpt.path == f"{root}/train/checkpoint_2026-01-01_00-00-01" and read_trainer_state(ckpt) == {"step": 2}
    with checkpoint_files(ckpt, DRAFT_FILES) as d:
        assert sorted(p.name for p in d.iterdir()) == sorted(DRAFT_FILES)  # no policy/
        tensors, meta = load_draft_state(d)
        assert meta["version"] == 2 and torch.equal(tensors["head.w"], torch.full((4,), 2.0))
    assert not d.exists()
    with checkpoint_files(ckpt, ["missing.json"]) as d:
        assert d is None
    assert checkpoints(s3_uri("runs/none")) == []

    cfg = load_config(None, [f"model.path={tiny_llama_dir}", f"trainer.run_dir={tmp_path / 'run'}",
                             f"trainer.storage_path={uri}"])
    with pytest.raises(ConfigError, match=r"^trainer.storage_path=s3://.*holds checkpoints.*_2026-01-01_00-00-01"):
        check_resume(cfg, resume=False)
    check_resume(cfg, resume=True)
    bad = load_config(None, [f"model.path={tiny_llama_dir}", "trainer.storage_path=nosuchfs://bucket/run"])
    with pytest.raises(ConfigError, match=r"^trainer.storage_path=nosuchfs://bucket/run: Ray Train's checkpoints"):
        check_resume(bad, resume=False)
