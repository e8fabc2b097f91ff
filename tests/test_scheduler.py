"""The scheduler: placement plans for a few cluster shapes, the too-small
cluster error, GPU shares that cannot pair replicas and Train ranks per
device, the device check, the colocated plan honoured by Ray on simulated
1 x 8 and 2 x 4-GPU clusters, and the rollout pipeline's policy-lag bound."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from rayspec.batch import RolloutBatch
from rayspec.config import ConfigError, load_config
from rayspec.scheduler import ClusterFitError, plan_placement
from rayspec.scheduler.pipeline import PolicyLagError, RolloutPipeline
from rayspec.scheduler.placement import NODE_LABEL, NodeInfo, check_device_sharing, replan

ONE_NODE = [NodeInfo("a" * 56, cpus=2, memory=24 * 2**30, cores=(0, 1))]
TWO_GPU_NODES = [NodeInfo("0" * 56, cpus=16, gpus=8), NodeInfo("1" * 56, cpus=16, gpus=8)]


def _cfg(*overrides):
    return load_config(None, list(overrides))


def _gpu_cfg(layout, replica_gpus, worker_gpus=None, draft_gpus=0, n=8):
    return _cfg(f"scheduler.layout={layout}", f"rollout.num_replicas={n}", f"train.num_workers={n}",
                f"rollout.num_gpus_per_replica={replica_gpus}",
                f"train.num_gpus_per_worker={replica_gpus if worker_gpus is None else worker_gpus}",
                f"draft.num_gpus={draft_gpus}", "rollout.num_cpus_per_replica=1", "train.num_cpus_per_worker=1",
                "data.prompts_per_step=8")


def _nodes(plan, role):
    return [b.node_id for b in plan.role(role)]


def test_one_cpu_node_colocate_shares_every_core():
    plan = plan_placement(_cfg(), ONE_NODE)
    node = ONE_NODE[0].node_id
    assert {b.role for b in plan.bundles} == {"rollout", "train", "draft"}
    assert all(b.node_id == node for b in plan.bundles)
    assert plan.cores == {r: {node: [0, 1]} for r in ("rollout", "train", "draft")}
    assert plan.serve_options()["ray_actor_options"]["label_selector"] == {NODE_LABEL: node}


def test_one_cpu_node_split_gives_rollout_and_training_disjoint_cores():
    plan = plan_placement(_cfg("scheduler.layout=split", "scheduler.mode=async"), ONE_NODE)
    node = ONE_NODE[0].node_id
    assert plan.cores["rollout"] == {node: [0]}
    assert plan.cores["train"] == {node: [1]} and plan.cores["draft"] == {node: [1]}
    sc = plan.scaling_config()
    assert sc.num_workers == 2 and sc.resources_per_worker == {"CPU": 0.4}
    assert sc.label_selector == [{NODE_LABEL: node}] * 2


def test_two_gpu_nodes_colocate_lines_roles_up_node_by_node():
    plan = plan_placement(_gpu_cfg("colocate", 0.6, 0.3), TWO_GPU_NODES)
    n0, n1 = (n.node_id for n in TWO_GPU_NODES)
    assert _nodes(plan, "rollout") == [n0] * 4 + [n1] * 4
    assert _nodes(plan, "train") == [n0] * 4 + [n1] * 4
    assert plan.cores == {"rollout": {}, "train": {}, "draft": {}}  # GPU nodes: no core pinning
    opts = plan.serve_options()
    assert opts["max_replicas_per_node"] == 4
    assert opts["ray_actor_options"]["num_gpus"] == 0.6
    assert opts["ray_actor_options"]["label_selector"] == {NODE_LABEL: f"in({n0},{n1})"}


@pytest.mark.parametrize("shares, n, match", [
    ((0.5, 0.6, 0), 8, r"num_gpus_per_replica=0.5 must be > 0.5.*add up to 1.1 > 1 \(replica 0.5 \+ Train worker 0.6"),
    ((0.6, 0.3, 0.2), 8, r"add up to 1.1 > 1"),
    ((0.6, 0.15, 0), 8, r"num_gpus_per_worker=0.15 must be > \(1 - 0.6\) / 2"),
    ((0.6, 0.3, 0.1), 10, r"node 00000000 gets 5 replicas but has 4 GPUs"),
])
def test_colocated_gpu_shares_that_cannot_pair_one_replica_and_one_rank_per_device_are_refused(shares, n, match):
    nodes = [NodeInfo("0" * 56, cpus=16, gpus=4), NodeInfo("1" * 56, cpus=16, gpus=4)]
    r, t, d = shares
    with pytest.raises(ClusterFitError, match=match) as e:
        plan_placement(_cfg(*_gpu_overrides(r, t, d, n)), nodes)
    assert "rollout.num_gpus_per_replica=0.6 train.num_gpus_per_worker=0.3 draft.num_gpus=0.1" in str(e.value)


def test_colocate_with_whole_gpus_each_shares_no_device():
    plan = plan_placement(_gpu_cfg("colocate", 1), TWO_GPU_NODES)
    assert plan.serve_options()["ray_actor_options"]["num_gpus"] == 1


def test_colocate_with_more_train_workers_than_replicas_is_refused():
    with pytest.raises(ClusterFitError, match="gets 8 Train workers but 4 replicas"):
        plan_placement(_cfg(*_gpu_overrides(0.6, 0.3, 0.1, 8), "rollout.num_replicas=4"), TWO_GPU_NODES[:1])


def _gpu_overrides(r, t, d, n):
    return ["scheduler.layout=colocate", f"rollout.num_replicas={n}", f"train.num_workers={n}",
            f"rollout.num_gpus_per_replica={r}", f"train.num_gpus_per_worker={t}", f"draft.num_gpus={d}",
            "rollout.num_cpus_per_replica=1", "train.num_cpus_per_worker=1", f"data.prompts_per_step={n}"]


def test_device_sharing_check_names_the_device_and_its_occupants():
    a, b = "a" * 56, "b" * 56
    paired = {"rollout": [(a, "0"), (a, "1")], "train": [(a, "1"), (a, "0")], "draft": [(a, "0")]}
    table = check_device_sharing("colocate", paired)
    assert table.splitlines() == ["  node aaaaaaaa GPU 0: rollout 0, train 1, draft 0",
                                  "  node aaaaaaaa GPU 1: rollout 1, train 0"]
    assert check_device_sharing("colocate", {"rollout": [(a, None)], "train": [(a, None)]}) == ""  # CPU
    with pytest.raises(ClusterFitError, match=r"node aaaaaaaa GPU 1 holds 2 train processes \(rollout 1, train 0, train 1\)"):
        check_device_sharing("colocate", {**paired, "train": [(a, "1"), (a, "1")]})
    with pytest.raises(ClusterFitError, match=r"node bbbbbbbb GPU 0 holds a Train rank without a replica"):
        check_device_sharing("colocate", {**paired, "train": [(a, "0"), (b, "0")]})
    with pytest.raises(ClusterFitError, match=r"'split': node aaaaaaaa GPU 0 holds a replica and a Train rank"):
        check_device_sharing("split", {"rollout": [(a, "0")], "train": [(a, "0")]})


def test_two_gpu_nodes_split_gives_each_side_its_own_node():
    plan = plan_placement(_gpu_cfg("split", 1), TWO_GPU_NODES)
    n0, n1 = (n.node_id for n in TWO_GPU_NODES)
    assert _nodes(plan, "rollout") == [n0] * 8
    assert _nodes(plan, "train") == [n1] * 8 and _nodes(plan, "draft") == [n1]
    assert plan.scaling_config().use_gpu


@pytest.mark.parametrize("overrides, role, match", [
    (["rollout.num_cpus_per_replica=3"], "rollout", r"asks 1 x \{CPU: 3\} = 3 CPUs"),
    (["train.num_workers=4", "train.num_cpus_per_worker=1"], "train", r"asks 4 x \{CPU: 1\} = 4 CPUs"),
    (["scheduler.layout=split", "train.num_cpus_per_worker=1"], "train", r"do not fit in what is left"),
    (["rollout.num_cpus_per_replica=1", "train.num_cpus_per_worker=0.6"], None,
     r"roles sharing node aaaaaaaa ask 2.4 CPUs \(rollout 1, train 1.2, draft 0.2\); it has 2 "),
])
def test_too_small_cluster_names_role_ask_and_what_there_is(overrides, role, match):
    with pytest.raises(ClusterFitError, match=match) as e:
        plan_placement(_cfg(*overrides), ONE_NODE)
    if role:
        assert f"role '{role}'" in str(e.value)
    assert "2 CPUs, 0 GPUs" in str(e.value)


def _cpu_nodes(*cpus):
    """A head with no CPUs (the driver's) and one node of ``c`` CPUs (cores 0..c-1) per entry."""
    return [NodeInfo("h" * 56, cpus=0)] + [NodeInfo(str(i) * 56, cpus=c, cores=tuple(range(int(c))))
                                          for i, c in enumerate(cpus, 1)]


def test_replan_moves_only_what_ran_on_the_dead_node_onto_a_free_one():
    head, n1, n2, n3 = _cpu_nodes(1, 1, 1)
    cfg = _cfg("scheduler.layout=split")
    plan = plan_placement(cfg, [head, n1, n2, n3])
    assert (_nodes(plan, "rollout"), set(_nodes(plan, "train") + _nodes(plan, "draft"))) == \
        ([n1.node_id], {n2.node_id})
    assert replan(cfg, plan, [head, n1, n2, n3]) is plan  # nobody died
    after = replan(cfg, plan, [head, n2, n3])  # the rollout's node died
    assert _nodes(after, "rollout") == [n3.node_id] and after.cores["rollout"] == {n3.node_id: [0]}
    assert [b for b in after.bundles if b.role != "rollout"] == [b for b in plan.bundles if b.role != "rollout"]
    after = replan(cfg, plan, [head, n1, n3])  # the Train workers' and the DraftTrainer's
    assert _nodes(after, "train") == [n3.node_id] * 2 and _nodes(after, "draft") == [n3.node_id]
    assert after.cores["train"] == {n3.node_id: [0]} and after.role("rollout") == plan.role("rollout")
    assert [b.index for b in after.role("train")] == [0, 1]


def test_replan_of_colocated_roles_moves_a_replica_and_its_train_rank_together():
    head, n1, n2, n3 = _cpu_nodes(2, 2, 2)
    cfg = _cfg("rollout.num_replicas=2")
    plan = plan_placement(cfg, [head, n1, n2, n3])
    assert _nodes(plan, "rollout") == _nodes(plan, "train") == [n1.node_id, n2.node_id]
    after = replan(cfg, plan, [head, n2, n3])
    assert _nodes(after, "rollout") == _nodes(after, "train") == [n3.node_id, n2.node_id]
    assert _nodes(after, "draft") == [n3.node_id]  # it was beside replica 0 and rank 0
    assert after.serve_options()["ray_actor_options"]["label_selector"] == {NODE_LABEL: f"in({n2.node_id},{n3.node_id})"}


def test_replan_without_a_free_node_plans_again_or_names_what_is_missing():
    head, n1, n2 = _cpu_nodes(1, 2)
    cfg = _cfg("scheduler.layout=split")
    plan = plan_placement(cfg, [head, n1, n2])
    assert _nodes(plan, "rollout") == [n1.node_id]
    after = replan(cfg, plan, [head, n2])  # n2 alone holds both sides on disjoint cores
    assert {b.node_id for b in after.bundles} == {n2.node_id}
    assert after.cores["rollout"] == {n2.node_id: [0]} and after.cores["train"] == {n2.node_id: [1]}
    with pytest.raises(ClusterFitError, match=r"layout 'split': role 'rollout' asks 1 x \{CPU: 0.5\}.*role 'train'"):
        replan(cfg, plan_placement(cfg, [head, n1, n2]), [head, n1])


def test_gpu_roles_do_not_fit_a_cpu_cluster():
    with pytest.raises(ClusterFitError, match=r"role 'rollout' asks 1 x \{CPU: 0.5, GPU: 1\}.*0 GPUs"):
        plan_placement(_cfg("rollout.num_gpus_per_replica=1"), ONE_NODE)


def test_config_rejects_async_colocate_and_fractional_split_gpus():
    with pytest.raises(ConfigError, match="scheduler.mode='async'.*needs scheduler.layout=split"):
        _cfg("scheduler.mode=async")
    with pytest.raises(ConfigError, match="train.num_gpus_per_worker=0.5.*whole GPUs"):
        _cfg("scheduler.layout=split", "train.num_gpus_per_worker=0.5")
    with pytest.raises(ConfigError, match="scheduler.max_policy_lag=0"):
        _cfg("scheduler.layout=split", "scheduler.mode=async", "scheduler.max_policy_lag=0")


@pytest.fixture(scope="module")
def gpu_cluster():
    """Three simulated nodes, one with 4 GPUs and two with 2 (Ray accounting
    only, no GPU needed: Ray still assigns GPU ids and sets each process's
    CUDA_VISIBLE_DEVICES from them)."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # a cluster of its own (the shared session's tests run last)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 10, "num_gpus": 4, "object_store_memory": 100 * 2**20, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=5, num_gpus=2, object_store_memory=100 * 2**20)
    ray.init(address=cluster.address)
    from ray import serve

    serve.start(proxy_location="Disabled")
    yield
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def _place(plan, storage):
    """Start the roles as the driver does, in its order, with the options the
    plan hands them: the Serve deployment (``serve_options()``), the
    DraftTrainer's actor (``draft_options()``), then a real Ray Train
    TorchTrainer (``scaling_config()``, gloo). Returns {role: [(node id,
    physical GPU id)]}: the device each process computes on (a Train rank on
    the device Ray Train assigned it, as ``rl_worker_loop`` takes it)."""
    import json

    import ray
    from ray import serve
    from ray.train import RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    class Probe:  # defined here so Ray pickles it by value (tests/ is not importable by workers)
        def node_and_gpu(self):
            from rayspec.devices import assigned_gpu

            return ray.get_runtime_context().get_node_id(), assigned_gpu()

    def train_probe(config):
        import json
        import os

        import ray.train
        import ray.train.torch

        from rayspec.devices import assigned_gpu

        ctx = ray.train.get_context()
        used = assigned_gpu(ray.train.torch.get_device().index)  # as rl_worker_loop takes it
        assert used in [str(g) for g in ray.get_gpu_ids()], (used, ray.get_gpu_ids())
        with open(os.path.join(config["out"], f"rank{ctx.get_world_rank()}.json"), "w") as f:
            json.dump([ray.get_runtime_context().get_node_id(), used], f)

    n = len(plan.role("rollout"))
    app = serve.deployment(Probe, name="probe").options(num_replicas=n, **plan.serve_options())
    handle = serve.run(app.bind(), name="probe", route_prefix=None)
    out = {"rollout": sorted(tuple(r) for r in handle.broadcast("node_and_gpu").results())}
    assert len(out["rollout"]) == n
    draft = ray.remote(Probe).options(**plan.draft_options()).remote() if plan.role("draft") else None
    if draft is not None:
        out["draft"] = [tuple(ray.get(draft.node_and_gpu.remote(), timeout=120))]
    storage.mkdir()
    TorchTrainer(train_probe, train_loop_config={"out": str(storage)}, scaling_config=plan.scaling_config(),
                 torch_config=TorchConfig(backend="gloo"),
                 run_config=RunConfig(name="probe", storage_path=str(storage / "ray"))).fit()
    out["train"] = [tuple(json.loads((storage / f"rank{i}.json").read_text())) for i in range(len(plan.role("train")))]
    if draft is not None:
        ray.kill(draft)
    serve.delete("probe")
    return out


@pytest.mark.slow
def _qwen3_8b_dir(tmp_path: Path) -> Path:
    from transformers import AutoConfig

    from rayspec.model_shape import PRESETS

    fields = dict(PRESETS["qwen3-8b"])
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(tmp_path / "qwen3-8b")
    return tmp_path / "qwen3-8b"


def test_the_driver_checks_the_memory_plan_on_the_clusters_devices(tmp_path):
    """Before any role starts, the run's memory plan on the cluster's own GPU
    memory: refused where a device overflows, naming it and what to run to
    see the knobs; not checked where nvidia-smi cannot read the memory.
    CPU roles on one node: its host memory."""
    from rayspec.preflight import check_memory_plan

    model = _qwen3_8b_dir(tmp_path)
    preset = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "gpu.yaml"
    h100 = {n.node_id: 81559 * 2**20 for n in TWO_GPU_NODES}
    cfg = load_config(preset, ["rollout.num_replicas=16", "train.num_workers=16"])
    plan = check_memory_plan(cfg, str(model), TWO_GPU_NODES, h100)
    assert plan is not None and plan.devices[1].count == 15  # 2 nodes x 8, one with the DraftTrainer
    resident = load_config(preset, ["rollout.num_replicas=16", "train.num_workers=16", "train.offload_states=false",
                                    "train.deepspeed.zero_optimization.stage=1"])
    with pytest.raises(ClusterFitError, match=r"(?s)GPU with the DraftTrainer, rollout: .*model states \(ZeRO-1\)"
                                              r".*python -m jobs.project_memory"):
        check_memory_plan(resident, str(model), TWO_GPU_NODES, h100)
    assert check_memory_plan(resident, str(model), TWO_GPU_NODES, {TWO_GPU_NODES[0].node_id: 81559 * 2**20}) is None
    # CPU roles: one node's host memory (cpu_plan); over several nodes, not checked
    cpu = load_config(None, [])
    assert check_memory_plan(cpu, str(model), ONE_NODE, host_bytes=2**40).devices[0].name == "host memory of a node"
    with pytest.raises(ClusterFitError, match=r"(?s)this node's host memory:.*host memory of a node, policy update: "
                                              r".*--hardware cpu --host-gib 24"):
        check_memory_plan(cpu, str(model), ONE_NODE, host_bytes=24 * 2**30)  # an 8B policy
    assert check_memory_plan(cpu, str(model), ONE_NODE * 2) is None


def test_simulated_gpus_report_no_memory_so_the_plan_is_not_checked(gpu_cluster):
    from rayspec.preflight import gpu_memory_by_node
    from rayspec.scheduler.placement import cluster_nodes

    nodes = cluster_nodes()
    assert gpu_memory_by_node(nodes) == {n.node_id: None for n in nodes}  # no nvidia-smi on any node here


@pytest.mark.slow  # Serve, a DraftTrainer and Ray Train placed twice on a 3-node cluster: 50 s
def test_simulated_gpu_nodes_hold_what_the_layout_promises(gpu_cluster, tmp_path):
    """Colocated on 1 node x 4 GPUs and on 2 nodes x 2 GPUs, each device
    holds exactly one replica and one Train rank (the DraftTrainer joins one
    of them). (Split gives each role whole GPUs, which Ray never shares: the
    plan's unit tests cover it.)"""
    from rayspec.scheduler.placement import cluster_nodes

    nodes = cluster_nodes()
    big, small = [n for n in nodes if n.gpus == 4], [n for n in nodes if n.gpus == 2]
    assert len(big) == 1 and len(small) == 2
    for name, shape in (("1x4", big), ("2x2", small)):
        plan = plan_placement(_gpu_cfg("colocate", 0.6, 0.3, draft_gpus=0.1, n=4), shape)
        got = _place(plan, tmp_path / name)
        table = check_device_sharing("colocate", got)
        print(f"colocate {name}:\n{table}")
        devices = collections.Counter((node, gpu) for role in got for node, gpu in got[role])
        assert len(devices) == 4 and all(gpu is not None for node, gpu in devices)
        for role in ("rollout", "train"):
            assert sorted(got[role]) == sorted(devices), role  # one of each per device
        assert got["draft"][0] in devices


class _FakeReplicas:
    """Replicas as the pipeline sees them: a batch samples the weights the
    replica holds when it is submitted; a refit lands when waited on."""

    def __init__(self):
        self.version = 0

    def submit(self):
        version = self.version

        class Pending:
            def result(self):
                return RolloutBatch([[1]], [[2]], [[-0.1]], [0], policy_version=version), None

            def cancel(self):
                pass

        return Pending(), None

    def refit(self, version):
        replicas = self

        class Response:
            def results(self):
                replicas.version = version
                return [version]

        return Response()


@pytest.mark.parametrize("max_lag, lags", [(0, [0] * 6), (1, [0, 1, 1, 1, 1, 1]), (2, [0, 1, 2, 2, 2, 2])])
def test_pipeline_lag_is_bounded(max_lag, lags):
    replicas = _FakeReplicas()
    pipe = RolloutPipeline(replicas.submit, max_lag)
    got = []
    for version in range(6):  # the trainer's version at each step
        batch, _, _, lag = pipe.next(version)
        got.append(lag)
        assert lag == version - batch.policy_version
        pipe.refit(replicas.refit(version + 1))
    assert got == lags
    pipe.close()


def test_pipeline_refuses_a_batch_past_the_lag_bound():
    replicas = _FakeReplicas()
    pipe = RolloutPipeline(replicas.submit, 1)
    pipe.next(0)
    # the trainer skipped a refit: the batch generated ahead is now 2 versions old
    with pytest.raises(PolicyLagError, match="lag 2, allowed 0..1"):
        pipe.next(2)


@pytest.mark.slow
def test_job_stops_on_a_too_small_cluster_before_anything_starts(tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.grpo", "scheduler.layout=split", "train.num_cpus_per_worker=1",
         "ray.num_cpus=2", f"ray.object_store_memory={200 * 2**20}", f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: layout 'split'" in proc.stderr and "role 'train' asks 2 x {CPU: 1}" in proc.stderr
    assert not run_dir.exists()  # nothing written, no role started


def test_plan_without_waits_for_a_node_to_join_then_gives_up_naming_the_wait():
    from rayspec.scheduler.recovery import plan_without

    head, n1, n2, n3 = _cpu_nodes(1, 1, 1)
    cfg = _cfg("scheduler.layout=split")
    plan = plan_placement(cfg, [head, n1, n2])
    asked = []

    def joins_on_third_ask():
        asked.append(1)
        return [head, n1] + ([n3] if len(asked) >= 3 else [])

    after = plan_without(cfg, plan, joins_on_third_ask, wait_s=5, poll_s=0.01)
    assert len(asked) == 3 and _nodes(after, "train") == [n3.node_id] * 2
    with pytest.raises(ClusterFitError, match=r"role 'train'.*Waited 0.05 s for nodes to join \(scheduler.node_wait_s\)"):
        plan_without(cfg, plan, lambda: [head, n1], wait_s=0.05, poll_s=0.01)


def test_the_node_watch_moves_a_dead_nodes_roles_and_posts_the_loss(monkeypatch):
    """``NodeWatch.check`` on fakes of Ray's node table and of the roles:
    the rollout moves at once and its loss is posted; a Train move is posted
    when the next attempt starts; a layout the nodes left cannot hold is the
    watch's error, posted for rank 0 (which saves the last step it finished)
    before the rollout deployment goes."""
    from types import SimpleNamespace

    from rayspec import driver

    head, n1, n2, n3 = _cpu_nodes(1, 1, 1)
    cfg = _cfg("scheduler.layout=split", "scheduler.node_wait_s=0")
    alive = {head, n1, n2, n3}
    monkeypatch.setattr(driver, "alive_node_ids", lambda: {n.node_id for n in alive})
    monkeypatch.setattr(driver, "cluster_nodes", lambda: [n for n in (head, n1, n2, n3) if n in alive])
    monkeypatch.setattr(driver, "check_nodes_see_inputs", lambda cfg, plan, model_dir: None)
    posted, stopped, reasons = [], [], []
    monkeypatch.setattr(driver.ray, "get", lambda ref, timeout=None: ref)  # the fake actor answers at once

    class FakeRoles:
        def __init__(self):
            self.cfg, self.plan = cfg, plan_placement(cfg, [head, n1, n2, n3])

        def follow(self, plan):
            moved = driver.moved_roles(self.plan, plan)
            self.plan = plan
            return moved

        def stop_rollout(self):
            stopped.append(list(reasons))

    roles = FakeRoles()
    events = SimpleNamespace(post=SimpleNamespace(remote=posted.append), stop=SimpleNamespace(remote=reasons.append))
    watch = driver.NodeWatch(roles, events, "model")
    assert watch.check() is None and posted == []
    alive.discard(n1)  # the rollout's node
    event = watch.check()
    assert (event["nodes"], event["lost"], event["moved"]) == ([n1.node_id[:8]], {"rollout": [0]},
                                                              {"rollout": [n3.node_id[:8]]})
    assert posted == [event] and watch.check() is None
    alive.discard(n2)  # the training node: nowhere to go
    assert watch.check() is None
    assert isinstance(watch.error, ClusterFitError) and "role 'train'" in str(watch.error)
    assert stopped == [[str(watch.error)]]  # rank 0 told why before its rollout fails
    # a Train move is posted when the next attempt starts
    watch2 = driver.NodeWatch(FakeRoles(), events, "model")
    alive.update({n1, n2})
    alive.discard(n2)
    event = watch2.check()
    assert event["moved"] == {"train": [n3.node_id[:8]] * 2, "draft": [n3.node_id[:8]]} and posted[-1] is not event
    watch2.take_train_moves()
    assert posted[-1] is event


def test_a_rollout_waiting_for_replicas_gives_up_when_the_run_stops():
    """A rollout's request that no replica will answer (queued for a
    deployment the driver deleted) gives up once the run says it stops,
    naming why, and cancels its shards; without a word it waits on."""
    import threading

    from rayspec.rollout.client import LocalReplicas, RolloutClient, RolloutStopped

    release, asked = threading.Event(), []

    class Stuck:
        def generate(self, **kw):
            release.wait(30)
            raise AssertionError("released")

    def stopped():
        asked.append(1)
        return "role 'rollout' fits no node left" if len(asked) >= 3 else None

    pending = RolloutClient(LocalReplicas([Stuck()]), 1, stopped=stopped).submit([[1, 2]])
    pending.poll_s = 0.05
    with pytest.raises(RolloutStopped, match="role 'rollout' fits no node left"):
        pending.result()
    assert len(asked) == 3
    release.set()


def test_a_replica_that_dies_during_a_broadcast_is_left_out_and_other_errors_still_raise():
    """A query broadcast (``busy_intervals``, ``versions``) that meets a
    replica whose node just died answers with the others; a refit's
    bookkeeping (``return_exceptions``) still sees the death; an error of a
    live replica raises; no replica running at all answers nothing."""
    import ray
    from ray.serve.exceptions import DeploymentUnavailableError

    from rayspec.rollout.client import _Broadcast

    class Response:
        def __init__(self, out):
            self.out = out

        def results(self, return_exceptions=False):
            if isinstance(self.out, BaseException):
                raise self.out
            assert return_exceptions
            return list(self.out)

    died = ray.exceptions.ActorDiedError()
    assert _Broadcast(Response([{"policy": 3}, died])).results() == [{"policy": 3}]
    assert _Broadcast(Response([1, died])).results(return_exceptions=True) == [1, died]
    with pytest.raises(ValueError, match="bad"):
        _Broadcast(Response([1, ValueError("bad")])).results()
    assert _Broadcast(Response(DeploymentUnavailableError("rayspec-rollout"))).results() == []
