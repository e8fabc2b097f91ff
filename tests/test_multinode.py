"""Across Ray nodes, on simulated nodes of one host (``rayspec.tools.local_cluster``:
each with a HOME, CPU cores, ``/dev/shm`` and a view of the filesystem of its own, the
driver's directory hidden from the others): what each node has, the check that every
node running a role sees the run's inputs, the main job colocated over two nodes, and nodes
that die mid-run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rayspec.config import ConfigError, load_config
from rayspec.files import content_digest
from rayspec.preflight import node_inputs
from tests.test_tracking import wandb_offline_history

REPO = Path(__file__).resolve().parents[1]


def test_content_digest_tells_files_and_directories_apart(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.json").write_text("{}")
    (tmp_path / "a" / "w.bin").write_bytes(os.urandom(3 << 20))
    d = content_digest(tmp_path / "a")
    assert d is not None and content_digest(tmp_path / "a") == d
    assert content_digest(tmp_path / "missing") is None
    (tmp_path / "a" / "x.json").write_text("{ }")
    assert content_digest(tmp_path / "a") != d
    # the middle of a large file is not read: its size and edges are
    f = tmp_path / "a" / "w.bin"
    before = content_digest(f)
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    assert content_digest(f) != before


def test_node_inputs_lists_what_roles_read_from_files(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    cfg = load_config(None, ["data.name=files", f"data.path={data}",
                             f"reward.functions=[math_verify,{tmp_path}/r.py:fn]",
                             f"rollout.tools=[{tmp_path}/t.py:mul]", "rollout.engine_cls=async"])
    assert node_inputs(cfg) == [("data.path", str(data)), ("reward.functions[1]", f"{tmp_path}/r.py"),
                                ("rollout.tools[0]", f"{tmp_path}/t.py")]
    assert node_inputs(load_config(None, [])) == []  # the built-in task and rewards: nothing to read


def test_nodes_find_the_torch_extensions_the_host_built(tmp_path, monkeypatch):
    """A simulated node's TORCH_EXTENSIONS_DIR is the directory the host's
    torch builds DeepSpeed's ops in (install_node.sh builds them there): the
    root torch defaults to holds them one folder down (``py311_cpu``)."""
    from torch.utils.cpp_extension import _get_build_directory

    from rayspec.tools.local_cluster import torch_extensions_dir

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert torch_extensions_dir() == os.path.dirname(_get_build_directory("fused_adam", verbose=False))
    assert torch_extensions_dir().startswith(str(tmp_path / ".cache" / "torch_extensions" / "py"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert torch_extensions_dir() == str(tmp_path / "ext")


def _records(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head (the driver's node, no CPUs for roles) and two 1-CPU nodes,
    node1 on host core 0 and node2 on core 1."""
    import ray

    from rayspec.driver import NAMESPACE
    from rayspec.tools.local_cluster import LocalCluster, NodeSpec

    ray.shutdown()  # a cluster of its own (the shared session's tests run last)
    cluster = LocalCluster(tmp_path_factory.mktemp("lc", numbered=True), NodeSpec(0),  # a dead node seen in 3 s
                           system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3})
    try:
        for cores in ((0,), (1,)):
            cluster.add_node(NodeSpec(1, cores, 512 << 20))
        ray.init(address=cluster.address, namespace=NAMESPACE)
        yield cluster
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_simulated_nodes_have_cores_homes_and_directories_of_their_own(two_nodes):
    import ray

    from rayspec.scheduler.placement import cluster_nodes

    secret = two_nodes.root / "head" / "driver-only.txt"
    secret.write_text("x")

    def facts():
        return os.environ["HOME"], sorted(os.sched_getaffinity(0)), secret.exists()

    probe = ray.remote(num_cpus=0)(facts)
    nodes = {n.node_id: n for n in cluster_nodes()}
    for name, core in (("node1", 0), ("node2", 1)):
        node = two_nodes.node_id(name)
        home, cores, sees = ray.get(probe.options(label_selector={"ray.io/node-id": node}).remote())
        assert (home, cores, sees) == (str(two_nodes.home(name)), [core], False)
        assert nodes[node].cores == (core,) and nodes[node].cpus == 1


@pytest.mark.slow
def test_every_node_with_a_role_must_see_the_run_dir_the_policy_and_the_inputs(two_nodes, tiny_llama_dir,
                                                                                tmp_path):
    from rayspec.preflight import check_nodes_see_inputs
    from rayspec.scheduler import plan_placement
    from rayspec.scheduler.placement import cluster_nodes

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "What is 1+1?", "answer": "2"}\n')
    shared = [f"model.path={tiny_llama_dir}", "scheduler.layout=split", "data.name=files", f"data.path={data}"]
    plan = plan_placement(load_config(None, shared), cluster_nodes())
    assert {b.node_id for b in plan.bundles} == {two_nodes.node_id("node1"), two_nodes.node_id("node2")}
    check_nodes_see_inputs(load_config(None, shared + [f"trainer.run_dir={tmp_path / 'run'}"]), plan,
                           str(tiny_llama_dir))

    # on the driver's node only: the run directory and Ray Train's storage path (created for the check, then
    # removed), a data file
    private = two_nodes.root / "head"
    (private / "train.jsonl").write_text(data.read_text())
    run_dir, storage = private / "run", private / "checkpoints"
    cfg = load_config(None, shared + [f"trainer.run_dir={run_dir}", f"trainer.storage_path={storage}",
                                      f"data.path={private / 'train.jsonl'}"])
    with pytest.raises(ConfigError) as e:
        check_nodes_see_inputs(cfg, plan, str(tiny_llama_dir))
    msg = str(e.value)
    for name in ("node1", "node2"):
        node = two_nodes.node_id(name)[:8]
        assert f"trainer.run_dir={run_dir}: node {node}" in msg and f"data.path={private / 'train.jsonl'}: node {node}" in msg
        assert f"trainer.storage_path={storage}: node {node}" in msg
    assert "runs rollout)" in msg and "runs draft, train)" in msg
    assert not run_dir.exists() and not storage.exists()


@pytest.mark.slow
def test_each_node_resolves_the_bundled_policy_in_its_own_home(two_nodes, smollm2_dir, tmp_path):
    """The bundled policy, dequantised on the driver's node, is dequantised
    again on a node that runs a role, into that node's own HOME (as
    ``cluster/install_node.sh`` does on a real node), with the same files."""
    from rayspec.preflight import check_nodes_see_inputs
    from rayspec.scheduler.placement import Bundle, PlacementPlan, cluster_nodes

    node1 = two_nodes.node_id("node1")
    plan = PlacementPlan("split", cluster_nodes(), [Bundle("rollout", 0, {"CPU": 0.5}, node1)])
    cfg = load_config(None, [f"trainer.run_dir={tmp_path / 'run'}"])  # model.path: the bundled one, ~/.cache
    check_nodes_see_inputs(cfg, plan, str(smollm2_dir))
    model = Path(".cache/rayspec/models/smollm2-135m-instruct/model.safetensors")
    assert (two_nodes.home("node1") / model).is_file() and not (two_nodes.home("node2") / model).exists()


@pytest.mark.slow
def test_the_main_job_colocated_over_two_nodes(two_nodes, tiny_llama_dir, tmp_path):
    """The main job with one replica and one Train worker on each node (the
    DraftTrainer beside rank 0's): each record's replicas ran on the nodes
    planned, the refits reached both over the collective, and the trained
    policy and head are saved. The driver (on the head node) reports every
    step to W&B (offline) and MLflow (SQLite), read back with their readers."""
    from mlflow.tracking import MlflowClient

    from rayspec import driver
    from rayspec.scheduler import plan_placement
    from rayspec.scheduler.placement import cluster_nodes
    from tests.conftest import IN_PROCESS

    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"model.path={tiny_llama_dir}", "model.dtype=float32", "rollout.num_replicas=2",
                             "rollout.num_cpus_per_replica=0.4", "trainer.steps=2", "trainer.eval_every=0",
                             "grpo.max_new_tokens=12", "data.prompts_per_step=2", "grpo.group_size=4",
                             f"trainer.run_dir={run_dir}", "trainer.report_to=[tensorboard,wandb,mlflow]",
                             "trainer.wandb_mode=offline", *IN_PROCESS])
    plan = plan_placement(cfg, cluster_nodes())
    workers = {two_nodes.node_id("node1"), two_nodes.node_id("node2")}
    assert {b.node_id for b in plan.role("rollout")} == {b.node_id for b in plan.role("train")} == workers
    driver.run(cfg)
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    # one shard per replica (the in-process engine), routed by Serve, which may send every shard of a step,
    # and of a 2-step run, to one replica (it did once): every record names the nodes that served it. The
    # replica on the other node took each refit over the network all the same (a refit that fails fails the run)
    served = [{e["node"] for e in r["replicas"].values()} for r in recs]
    assert all(nodes and nodes <= {n[:8] for n in workers} for nodes in served)
    assert all(r["weight_sync_transport"] == "collective" and r["layout"] == "colocate" for r in recs)
    assert (run_dir / "policy" / "model.safetensors").is_file() and (run_dir / "draft_head" / "config.json").is_file()
    rows, _, summary = wandb_offline_history(run_dir)
    assert [(r["step"], r["reward_mean"]) for r in rows if "reward_mean" in r] == [(r["step"], r["reward_mean"])
                                                                                  for r in recs]
    assert summary["draft_head_path"] == str(run_dir / "draft_head")
    mlflow_run = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    history = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}").get_metric_history(mlflow_run, "time_step_s")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["time_step_s"])) for r in recs]


@pytest.mark.slow
def test_nodes_that_die_mid_run_lose_no_step_and_a_run_they_cannot_hold_saves_and_stops(tiny_llama_dir, tmp_path,
                                                                                        monkeypatch):
    """The main job async on the split layout over three 1-CPU nodes (the
    rollout on one, the Train workers and the DraftTrainer on another, one
    free), a checkpoint every 2 steps. The rollout's node is killed after
    step 1: its replica starts again on the free node and catches up, the
    Train workers never stop. The training node is killed in step 4: no
    node left can hold the Train workers, so the run waits; a node joins,
    the Train workers and the DraftTrainer start there and the run goes on
    from step 2's checkpoint. Every step trains once, on the prompts an
    uninterrupted run draws, and the records say which node died and where
    its roles went. After step 5 the replica's node dies too, with no node
    to spare (the head has no CPUs): after ``scheduler.node_wait_s`` the run
    stops with a ClusterFitError naming the rollout, and the Train workers
    saved the last step they finished first (its policy version, the
    prompt cursor before the next batch), whatever ``trainer.save_steps``
    says. One run for the three losses: each start of a role costs a
    minute on these 1-CPU nodes."""
    import threading
    import time

    import ray

    from rayspec.data import PromptSource, train_and_heldout
    from rayspec.driver import NAMESPACE, run
    from rayspec.scheduler import plan_placement
    from rayspec.scheduler.placement import ClusterFitError, cluster_nodes
    from rayspec.train.checkpoint import checkpoints, read_trainer_state
    from rayspec.tools.local_cluster import LocalCluster, NodeSpec
    from tests.conftest import IN_PROCESS, STEP_RECORD_KEYS

    ray.shutdown()
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "15")  # a group pinned to a dead node: give up soon
    cluster = LocalCluster(tmp_path / "lc", NodeSpec(0),
                           system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3})
    run_dir = tmp_path / "run"
    steps = 7  # the run stops after step 5 or 6 (the last node loss)
    cores = {"node1": 0, "node2": 1, "node3": 0}  # two cores: the free node shares one
    try:
        nodes = {name: cluster.add_node(NodeSpec(1, (core,), 384 << 20)) for name, core in cores.items()}
        ray.init(address=cluster.address, namespace=NAMESPACE)
        cfg = load_config(None, [f"model.path={tiny_llama_dir}", "model.dtype=float32", f"trainer.steps={steps}",
                                 f"trainer.run_dir={run_dir}", "trainer.save_steps=2", "trainer.eval_every=2",
                                 "data.eval_num_problems=4", "trainer.eval_samples=1", "grpo.max_new_tokens=12",
                                 "data.prompts_per_step=2", "grpo.group_size=4", "draft.steps_per_rl_step=2",
                                 "scheduler.layout=split", "scheduler.mode=async", "scheduler.node_wait_s=20",
                                 # a replica in a weight-sync rendezvous whose rank 0 dies with its node waits
                                 # this out, its engine locked (vLLM's has no abort): 600 s stalled one suite run
                                 "rollout.weight_sync.timeout_s=60", *IN_PROCESS])
        plan = plan_placement(cfg, cluster_nodes())  # the driver's own plan of the same nodes
        by_id = {node: n for n, node in nodes.items()}
        rollout, train = by_id[plan.role("rollout")[0].node_id], by_id[plan.role("train")[0].node_id]
        (free,) = set(nodes) - {rollout, train}
        assert {by_id[b.node_id] for b in plan.role("train") + plan.role("draft")} == {train}
        done: list[str] = []
        errors: list[BaseException] = []

        def inject():
            try:
                deadline = time.monotonic() + 900
                while len(_records(run_dir)) < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.5)
                cluster.kill_node(rollout)
                done.append(rollout)
                while len(_records(run_dir)) < 3:
                    assert time.monotonic() < deadline
                    time.sleep(0.5)
                cluster.kill_node(train)
                done.append(train)
                cluster.wait_dead(nodes[train])
                time.sleep(2)  # the run waits for a node (the one left holds the rollout)
                nodes["node4"] = cluster.add_node(NodeSpec(1, (1 - cores[free],), 384 << 20))
                done.append("node4")
                while len(_records(run_dir)) < 5:
                    assert time.monotonic() < deadline
                    time.sleep(0.5)
                cluster.kill_node(free)  # the replica's node: nothing left can hold the rollout
                done.append(free)
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=inject, daemon=True)
        thread.start()
        t0 = time.monotonic()
        with pytest.raises(ClusterFitError) as stopped:
            run(cfg)
        elapsed = time.monotonic() - t0
        thread.join(timeout=5)
    finally:
        cluster.shutdown()
    assert not errors and done == [rollout, train, "node4", free], (done, errors)
    got = _records(run_dir)
    last = got[-1]["step"]
    source = PromptSource(train_and_heldout(cfg.data, cfg.data.eval_num_problems)[0], cfg.data.prompts_per_step,
                          cfg.data.seed)
    assert last in (5, 6) and [r["step"] for r in got] == list(range(1, last + 1))
    assert [r["problem_ids"] for r in got] == [[p.index for p in source.next_batch()] for _ in range(last)]
    msg = str(stopped.value)
    assert "role 'rollout'" in msg and "scheduler.node_wait_s" in msg, msg
    assert f"The state after step {last} is saved" in msg and f"resume={run_dir}" in msg, msg
    state = read_trainer_state(checkpoints(str(run_dir / "ray_train"))[-1])
    assert (state["step"], state["policy_version"]) == (last, last) and "draft_version" in state
    for r in got:
        assert 0 <= r["policy_lag"] <= 1 and r["policy_version"] == r["step"] - 1 - r["policy_lag"], r["step"]
    short = {name: node[:8] for name, node in nodes.items()}
    losses = [e for r in got for e in r.get("node_failures", [])]
    assert [(e["nodes"], e["lost"], e["moved"]) for e in losses] == [
        ([short[rollout]], {"rollout": [0]}, {"rollout": [short[free]]}),
        ([short[train]], {"train": [0, 1], "draft": [0]}, {"train": [short["node4"]] * 2, "draft": [short["node4"]]})]
    assert all(e["recovered_s"] > 0 for e in losses)
    replica_nodes = [{e["node"] for e in r["replicas"].values()} for r in got]
    assert replica_nodes[0] == {short[rollout]} and replica_nodes[-1] == {short[free]}
    # the training node died in step 4 (or 5): the run went on from the last checkpoint, and the steps the
    # failed attempt had recorded past it are set apart, not repeated; the batches it had drawn are drawn again
    assert {r["step"] for r in _records(run_dir, "metrics.discarded.jsonl")} <= {3, 4}
    assert any(r["rollout_regenerated"] for r in got[2:])
    versions = [r["draft_version"] for r in got]
    assert versions == sorted(versions) and versions[-1] > versions[1] and got[-1]["draft_alive"] == 1
    # held-out evaluations of versions 0, 2 and 4, once each (the restored attempt evaluates after step 2's
    # checkpoint); one of version 6 needs the replica: the run stopped in it
    assert sorted(e["policy_version"] for r in got for e in r.get("evals", [])) == [0, 2, 4]
    for r in got:
        assert STEP_RECORD_KEYS <= r.keys()
        assert (r["layout"], r["mode"], r["weight_sync_transport"]) == ("split", "async", "collective")
        for role in ("rollout", "train", "draft"):
            assert 0 <= r[f"idle_{role}_s"] <= r["time_step_s"]
    print(f"\nthe run with three node losses: {elapsed:.0f} s; recovered in "
          + ", ".join(f"{e['recovered_s']:.0f} s" for e in losses) + f"; then {msg}")
