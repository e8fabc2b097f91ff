"""The scheduler: placement plans for a few cluster shapes, the too-small
cluster error, the plan honoured by Ray on a simulated 2 x 8-GPU cluster, and
the rollout pipeline's policy-lag bound."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from rayspec.batch import RolloutBatch
from rayspec.config import ConfigError, load_config
from rayspec.scheduler import ClusterFitError, plan_placement
from rayspec.scheduler.pipeline import PolicyLagError, RolloutPipeline
from rayspec.scheduler.placement import NODE_LABEL, NodeInfo

ONE_NODE = [NodeInfo("a" * 56, cpus=2, memory=24 * 2**30, cores=(0, 1))]
TWO_GPU_NODES = [NodeInfo("0" * 56, cpus=16, gpus=8), NodeInfo("1" * 56, cpus=16, gpus=8)]


def _cfg(*overrides):
    return load_config(None, list(overrides))


def _gpu_cfg(layout, gpus):
    return _cfg(f"scheduler.layout={layout}", "rollout.num_replicas=8", "train.num_workers=8",
                f"rollout.num_gpus_per_replica={gpus}", f"train.gpus_per_worker={gpus}",
                "rollout.num_cpus_per_replica=1", "train.cpus_per_worker=1", "data.prompts_per_step=8")


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
    plan = plan_placement(_gpu_cfg("colocate", 0.5), TWO_GPU_NODES)
    n0, n1 = (n.node_id for n in TWO_GPU_NODES)
    assert _nodes(plan, "rollout") == [n0] * 4 + [n1] * 4
    assert _nodes(plan, "train") == [n0] * 4 + [n1] * 4
    assert plan.cores == {"rollout": {}, "train": {}, "draft": {}}  # GPU nodes: no core pinning
    opts = plan.serve_options()
    assert opts["max_replicas_per_node"] == 4
    assert opts["ray_actor_options"]["num_gpus"] == 0.5
    assert opts["ray_actor_options"]["label_selector"] == {NODE_LABEL: f"in({n0},{n1})"}


def test_two_gpu_nodes_split_gives_each_side_its_own_node():
    plan = plan_placement(_gpu_cfg("split", 1), TWO_GPU_NODES)
    n0, n1 = (n.node_id for n in TWO_GPU_NODES)
    assert _nodes(plan, "rollout") == [n0] * 8
    assert _nodes(plan, "train") == [n1] * 8 and _nodes(plan, "draft") == [n1]
    assert plan.scaling_config().use_gpu


@pytest.mark.parametrize("overrides, role, match", [
    (["rollout.num_cpus_per_replica=3"], "rollout", r"asks 1 x \{CPU: 3\} = 3 CPUs"),
    (["train.num_workers=4", "train.cpus_per_worker=1"], "train", r"asks 4 x \{CPU: 1\} = 4 CPUs"),
    (["scheduler.layout=split", "train.cpus_per_worker=1"], "train", r"do not fit in what is left"),
    (["rollout.num_cpus_per_replica=1", "train.cpus_per_worker=0.6"], None,
     r"roles sharing node aaaaaaaa ask 2.4 CPUs \(rollout 1, train 1.2, draft 0.2\); it has 2 "),
])
def test_too_small_cluster_names_role_ask_and_what_there_is(overrides, role, match):
    with pytest.raises(ClusterFitError, match=match) as e:
        plan_placement(_cfg(*overrides), ONE_NODE)
    if role:
        assert f"role '{role}'" in str(e.value)
    assert "2 CPUs, 0 GPUs" in str(e.value)


def test_gpu_roles_do_not_fit_a_cpu_cluster():
    with pytest.raises(ClusterFitError, match=r"role 'rollout' asks 1 x \{CPU: 0.5, GPU: 1\}.*0 GPUs"):
        plan_placement(_cfg("rollout.num_gpus_per_replica=1"), ONE_NODE)


def test_config_rejects_async_colocate_and_fractional_split_gpus():
    with pytest.raises(ConfigError, match="scheduler.mode='async'.*needs scheduler.layout=split"):
        _cfg("scheduler.mode=async")
    with pytest.raises(ConfigError, match="train.gpus_per_worker=0.5.*whole GPUs"):
        _cfg("scheduler.layout=split", "train.gpus_per_worker=0.5")
    with pytest.raises(ConfigError, match="scheduler.max_policy_lag=0"):
        _cfg("scheduler.layout=split", "scheduler.mode=async", "scheduler.max_policy_lag=0")


@pytest.fixture(scope="module")
def gpu_cluster():
    """Two simulated nodes with 8 GPUs each (Ray accounting only: no GPU needed)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 16, "num_gpus": 8, "object_store_memory": 100 * 2**20, "include_dashboard": False})
    cluster.add_node(num_cpus=16, num_gpus=8, object_store_memory=100 * 2**20)
    ray.init(address=cluster.address)
    from ray import serve

    serve.start(proxy_location="Disabled")
    yield
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def _place(plan):
    """Start the roles with the options the plan hands them: a Serve
    deployment with ``serve_options()`` for the replicas, one actor per Train
    worker with the ScalingConfig's resources and label selector, the
    DraftTrainer's ``draft_options()``. Returns {role: [(node, gpu ids)]}."""
    import ray
    from ray import serve

    class Probe:  # defined here so Ray pickles it by value (tests/ is not importable by workers)
        def where(self):
            ctx = ray.get_runtime_context()
            return ctx.get_node_id(), tuple(ray.get_gpu_ids()), ctx.get_actor_id()

    n = len(plan.role("rollout"))
    app = serve.deployment(Probe, name="probe").options(num_replicas=n, **plan.serve_options())
    handle = serve.run(app.bind(), name="probe", route_prefix=None)
    rollout = {tuple(r) for r in handle.broadcast("where").results()}  # one per replica
    sc = plan.scaling_config()
    opts = {"train": [{"num_cpus": sc.resources_per_worker.get("CPU", 0),
                       "num_gpus": sc.resources_per_worker.get("GPU", 0), "label_selector": sel}
                      for sel in sc.label_selector],
            "draft": [plan.draft_options()]}
    actors = {role: [ray.remote(Probe).options(**o).remote() for o in os_] for role, os_ in opts.items()}
    out = {role: [r[:2] for r in ray.get([a.where.remote() for a in acts], timeout=120)]
           for role, acts in actors.items()}
    for acts in actors.values():
        for a in acts:
            ray.kill(a)
    serve.delete("probe")
    out["rollout"] = sorted(r[:2] for r in rollout)
    assert len(out["rollout"]) == n
    return out


@pytest.mark.slow
def test_simulated_two_gpu_nodes_honour_the_plan(gpu_cluster):
    from rayspec.scheduler.placement import cluster_nodes

    nodes = cluster_nodes()
    assert len(nodes) == 2 and all(n.gpus == 8 for n in nodes)
    split = plan_placement(_gpu_cfg("split", 1), nodes)
    got = _place(split)
    assert {n for n, _ in got["rollout"]} == {nodes[0].node_id}
    assert {n for n, _ in got["train"]} == {nodes[1].node_id}
    # whole, distinct devices per replica / worker
    assert sorted(g for _, (g,) in got["rollout"]) == list(range(8))
    assert sorted(g for _, (g,) in got["train"]) == list(range(8))

    colocate = plan_placement(_gpu_cfg("colocate", 0.5), nodes)
    got = _place(colocate)
    for role in ("rollout", "train"):
        per_node = [sum(n == node.node_id for n, _ in got[role]) for node in nodes]
        assert per_node == [4, 4], role
    # Ray picks the devices within a node: at most two 0.5-GPU processes per device
    for node in nodes:
        per_dev = collections.Counter(g for role in ("rollout", "train")
                                      for n, gs in got[role] if n == node.node_id for g in gs)
        assert sum(per_dev.values()) == 8 and max(per_dev.values()) <= 2


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
        [sys.executable, "-m", "jobs.grpo", "scheduler.layout=split", "train.cpus_per_worker=1",
         "ray.num_cpus=2", f"ray.object_store_memory={200 * 2**20}", f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: layout 'split'" in proc.stderr and "role 'train' asks 2 x {CPU: 1}" in proc.stderr
    assert not run_dir.exists()  # nothing written, no role started
