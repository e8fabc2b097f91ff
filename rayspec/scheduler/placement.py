"""The placement plan: which node (and, on CPU-only nodes, which cores) each
role's bundles get, checked against the cluster before anything starts.

Roles and their bundles (one resource dict per unit, from the config):

- ``rollout``: ``rollout.num_replicas`` x {CPU: num_cpus_per_replica, GPU: num_gpus_per_replica}
- ``train``:   ``train.num_workers``   x {CPU: num_cpus_per_worker, GPU: num_gpus_per_worker}
- ``draft``:   1 x {CPU: draft.num_cpus, GPU: draft.num_gpus} (when online draft training runs)

Layouts:

- ``colocate``: every role is spread over the same nodes in the same
  proportion (replica i and Train worker i land on the same node) and shares
  its devices through fractional resources; the phases of a step take turns.
  On GPU nodes each device holds one replica and one Train rank (and the
  DraftTrainer joins one of them): Ray gives a fractional GPU request the
  device with the least free share that fits (best fit; Ray 2.60, checked on
  a cluster of simulated GPUs), in placement order, and the driver places the
  replicas first, then the DraftTrainer, then the Train workers. The shares
  make that pairing the only fit (``_check_gpu_pairing``), and the Train
  workers check the devices they actually got (``check_device_sharing``).
- ``split``: the rollout role gets the first nodes its bundles fill, training
  (Train workers + DraftTrainer) the rest. On one node the two sides share it
  with disjoint resources: whole GPUs each, or on a CPU-only node disjoint
  core sets (rollout: the first ceil(its CPUs) cores), since Ray's CPU
  resource is accounting only and does not pin threads.

Ray, Serve and Train create the actual placement groups from the plan's
options (a deployment's ``ray_actor_options``, a ``ScalingConfig``, an actor's
``.options``): each bundle is pinned to its node with a ``ray.io/node-id``
label selector, so the libraries keep their own restart and failure handling.
"""

from __future__ import annotations

import collections
import math
import os
from dataclasses import dataclass, field
from typing import Any

from rayspec.config import draft_online

NODE_LABEL = "ray.io/node-id"
ROLES = ("rollout", "train", "draft")
_EPS = 1e-9


class ClusterFitError(RuntimeError):
    """The requested layout does not fit the cluster; the message names the
    role, what it asks for and what the cluster has."""


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node.

    Attributes:
        node_id: Ray node id (hex), also its ``ray.io/node-id`` label.
        cpus / gpus: Ray resources of the node (logical CPUs, GPUs).
        memory: Ray ``memory`` resource (bytes).
        cores: CPU core ids on the node (for thread pinning).
        address: the node's IP address, as Ray knows it.
    """

    node_id: str
    cpus: float
    gpus: float = 0.0
    memory: float = 0.0
    cores: tuple[int, ...] = ()
    address: str = ""

    def describe(self) -> str:
        return (f"node {self.node_id[:8]}{f' ({self.address})' if self.address else ''}: {self.cpus:g} CPUs, "
                f"{self.gpus:g} GPUs, {self.memory / 2**30:.1f} GiB")


@dataclass(frozen=True)
class Bundle:
    """One unit of a role: a replica, a Train worker, or the DraftTrainer.

    Attributes:
        role: ``rollout`` | ``train`` | ``draft``.
        index: replica / worker index within the role.
        resources: Ray resources, e.g. {"CPU": 0.5, "GPU": 1.0}.
        node_id: the node the plan puts it on.
    """

    role: str
    index: int
    resources: dict[str, float]
    node_id: str


@dataclass
class PlacementPlan:
    """Where each role runs; built by ``plan_placement``.

    Attributes:
        layout: ``colocate`` | ``split``.
        nodes: the cluster's alive nodes, in plan order.
        bundles: every role's bundles with their nodes.
        cores: per role, per node id, the CPU cores the role's threads are
            pinned to (CPU-only nodes; empty on GPU nodes).
    """

    layout: str
    nodes: list[NodeInfo]
    bundles: list[Bundle]
    cores: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def role(self, name: str) -> list[Bundle]:
        return [b for b in self.bundles if b.role == name]

    def role_nodes(self, name: str) -> list[str]:
        """Node ids a role uses, in plan order."""
        ids = {b.node_id for b in self.role(name)}
        return [n.node_id for n in self.nodes if n.node_id in ids]

    def serve_options(self) -> dict[str, Any]:
        """Ray Serve deployment options for the rollout replicas: resources,
        a label selector over the rollout nodes, and at most the planned
        number of replicas per node."""
        reps = self.role("rollout")
        nodes = self.role_nodes("rollout")
        opts: dict[str, Any] = {
            "ray_actor_options": {**_actor_resources(reps[0].resources),
                                  "label_selector": _select(nodes)}}
        if len(nodes) > 1:
            opts["max_replicas_per_node"] = max(
                sum(b.node_id == n for b in reps) for n in nodes)
        return opts

    def scaling_config(self):
        """``ray.train.ScalingConfig`` for the policy's Train workers, each
        pinned to its planned node."""
        from ray.train import ScalingConfig

        workers = self.role("train")
        res = workers[0].resources
        return ScalingConfig(
            num_workers=len(workers), use_gpu=res.get("GPU", 0) > 0,
            resources_per_worker=dict(res), placement_strategy="PACK",
            label_selector=[{NODE_LABEL: b.node_id} for b in workers])

    def draft_options(self) -> dict[str, Any]:
        """``.options(...)`` for the DraftTrainer actor."""
        (b,) = self.role("draft")
        return {**_actor_resources(b.resources), "label_selector": {NODE_LABEL: b.node_id}}

    def describe(self) -> str:
        """Multi-line summary for the log: role -> nodes, resources, cores."""
        lines = [f"placement plan ({self.layout}) on {len(self.nodes)} node(s):"]
        for role in ROLES:
            bs = self.role(role)
            if not bs:
                continue
            per_node = ", ".join(
                f"{n[:8]} x{sum(b.node_id == n for b in bs)}"
                + (f" cores {','.join(map(str, self.cores[role][n]))}" if self.cores.get(role, {}).get(n) else "")
                for n in self.role_nodes(role))
            lines.append(f"  {role:<8} {len(bs)} x {_fmt(bs[0].resources)} on {per_node}")
        return "\n".join(lines)


def _actor_resources(res: dict[str, float]) -> dict[str, float]:
    return {"num_cpus": res.get("CPU", 0.0), "num_gpus": res.get("GPU", 0.0)}


def _select(node_ids: list[str]) -> dict[str, str]:
    return {NODE_LABEL: node_ids[0] if len(node_ids) == 1 else f"in({','.join(node_ids)})"}


def _fmt(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in res.items()) + "}" if res else "{}"


def _affinity() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def cluster_nodes(timeout_s: float = 120.0) -> list[NodeInfo]:
    """Alive nodes of the connected Ray cluster, the driver's node first.

    Core ids are the CPU affinity of a process on the node: this one's on
    the driver's node, elsewhere a zero-CPU task's, run on each node (its
    raylet's affinity, which its workers inherit), so the cores a role is
    pinned to are that node's own.

    Raises:
        ClusterFitError: a node did not answer within ``timeout_s`` (named).
    """
    import ray

    here = ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    probe = ray.remote(num_cpus=0)(_affinity)
    refs = {n["NodeID"]: probe.options(label_selector={NODE_LABEL: n["NodeID"]}).remote()
            for n in alive if n["NodeID"] != here}
    out = []
    for n in alive:
        res = n.get("Resources", {})
        if n["NodeID"] == here:
            cores = _affinity()
        else:
            try:
                cores = ray.get(refs[n["NodeID"]], timeout=timeout_s)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
                raise ClusterFitError(f"node {n['NodeID'][:8]} ({n.get('NodeManagerAddress')}) did not say which "
                                      f"CPU cores it has within {timeout_s:g} s: {type(e).__name__}") from e
        out.append(NodeInfo(n["NodeID"], float(res.get("CPU", 0.0)), float(res.get("GPU", 0.0)),
                            float(res.get("memory", 0.0)), cores, n.get("NodeManagerAddress", "")))
    out.sort(key=lambda x: x.node_id != here)
    return out


def role_bundles(cfg) -> dict[str, list[dict[str, float]]]:
    """Per role, one resource dict per unit, from the config."""
    def res(cpu: float, gpu: float) -> dict[str, float]:
        return {k: float(v) for k, v in (("CPU", cpu), ("GPU", gpu)) if v > 0}

    roles = {
        "rollout": [res(cfg.rollout.num_cpus_per_replica, cfg.rollout.num_gpus_per_replica)]
        * cfg.rollout.num_replicas,
        "train": [res(cfg.train.num_cpus_per_worker, cfg.train.num_gpus_per_worker)] * cfg.train.num_workers,
    }
    if draft_online(cfg):
        roles["draft"] = [res(cfg.draft.num_cpus, cfg.draft.num_gpus)]
    return roles


def _total(bundles: list[dict[str, float]], key: str) -> float:
    return sum(b.get(key, 0.0) for b in bundles)


def _asks(role: str, bundles: list[dict[str, float]]) -> str:
    return (f"role '{role}' asks {len(bundles)} x {_fmt(bundles[0])} = "
            f"{_total(bundles, 'CPU'):g} CPUs, {_total(bundles, 'GPU'):g} GPUs")


def _has(cluster: list[NodeInfo]) -> str:
    return (f"the cluster has {sum(n.cpus for n in cluster):g} CPUs, "
            f"{sum(n.gpus for n in cluster):g} GPUs ("
            + "; ".join(n.describe() for n in cluster) + ")")


def _spread(role: str, bundles: list[dict[str, float]], nodes: list[NodeInfo]) -> list[Bundle]:
    """Bundle i of m goes to node floor(i * len(nodes) / m): each node gets
    an equal share, in order (colocated roles line up node by node)."""
    m = len(bundles)
    return [Bundle(role, i, dict(r), nodes[i * len(nodes) // m].node_id)
            for i, r in enumerate(bundles)]


def _first_fit(role: str, bundles: list[dict[str, float]], nodes: list[NodeInfo],
               free: dict[str, dict[str, float]]) -> list[Bundle] | None:
    out = []
    for i, r in enumerate(bundles):
        for n in nodes:
            if all(free[n.node_id].get(k, 0.0) + _EPS >= v for k, v in r.items()):
                for k, v in r.items():
                    free[n.node_id][k] -= v
                out.append(Bundle(role, i, dict(r), n.node_id))
                break
        else:
            return None
    return out


def plan_placement(cfg, nodes: list[NodeInfo]) -> PlacementPlan:
    """Plan where every role of ``cfg`` runs on ``nodes`` (see module doc).

    Args:
        cfg: RunConfig (``scheduler.layout`` and each role's resources).
        nodes: the cluster, e.g. ``cluster_nodes()``.

    Returns:
        PlacementPlan.

    Raises:
        ClusterFitError: a role (or the roles sharing a node) asks for more
            CPUs/GPUs than the cluster or the node has.
    """
    return _place(cfg.scheduler.layout, role_bundles(cfg), nodes)


def _place(layout: str, roles: dict[str, list[dict[str, float]]], nodes: list[NodeInfo]) -> PlacementPlan:
    """``roles``' bundles placed on ``nodes`` by ``layout``'s rule (a role
    may be absent: ``replan`` places the lost bundles only)."""
    if not nodes:
        raise ClusterFitError("the Ray cluster has no alive nodes")
    for role, bs in roles.items():
        for key in ("CPU", "GPU"):
            have = sum(n.cpus if key == "CPU" else n.gpus for n in nodes)
            if _total(bs, key) > have + _EPS:
                raise ClusterFitError(f"layout '{layout}': {_asks(role, bs)}; {_has(nodes)}")
    if layout == "colocate":
        return _plan_colocate(roles, nodes)
    return _plan_split(roles, nodes)


def replan(cfg, plan: PlacementPlan, nodes: list[NodeInfo]) -> PlacementPlan:
    """The plan once some of ``plan``'s nodes are gone: what ran on the
    nodes still alive stays there; the bundles of the dead nodes are placed
    by the layout's own rule on the nodes no role uses (their cores those
    nodes' own). Where those cannot hold them, the whole plan is made again
    on the nodes alive (``plan_placement``: every role may move).

    Args:
        cfg: the run's config.
        plan: the plan the roles run on.
        nodes: the cluster's alive nodes (``cluster_nodes()``).

    Returns:
        The new plan (``plan`` itself where none of its nodes died).

    Raises:
        ClusterFitError: the nodes alive cannot hold the layout (naming
            what it asks and what is there).
    """
    alive = {n.node_id for n in nodes}
    lost = [b for b in plan.bundles if b.node_id not in alive]
    if not lost:
        return plan
    kept = [b for b in plan.bundles if b.node_id in alive]
    free = [n for n in nodes if not any(b.node_id == n.node_id for b in kept)]
    roles = {r: [b.resources for b in lost if b.role == r] for r in ROLES if any(b.role == r for b in lost)}
    try:
        sub = _place(plan.layout, roles, free)
    except ClusterFitError:
        return plan_placement(cfg, nodes)
    moved = [Bundle(b.role, b.index, b.resources, new.node_id)
             for r in roles for b, new in zip([b for b in lost if b.role == r], sub.role(r))]
    bundles = sorted(kept + moved, key=lambda b: (ROLES.index(b.role), b.index))
    cores = {r: {**{n: c for n, c in plan.cores.get(r, {}).items() if n in alive}, **sub.cores.get(r, {})}
             for r in {*plan.cores, *sub.cores}}
    return PlacementPlan(plan.layout, list(nodes), bundles, cores)


def _usable(bs: list[dict[str, float]], nodes: list[NodeInfo]) -> list[NodeInfo]:
    """Nodes that can host one of these bundles at all (GPU roles: GPU nodes)."""
    return [n for n in nodes if n.cpus + _EPS >= bs[0].get("CPU", 0.0)
            and n.gpus + _EPS >= bs[0].get("GPU", 0.0)]


def _plan_colocate(roles: dict[str, list[dict[str, float]]], nodes: list[NodeInfo]) -> PlacementPlan:
    # The rollout and train roles spread over the same nodes (those able to
    # host both); the DraftTrainer joins the first of them.
    paired = [r for r in ("rollout", "train") if roles.get(r)] or ["draft"]
    shared = [n for n in nodes if all(n in _usable(roles[r], nodes) for r in paired)]
    if not shared:
        raise ClusterFitError(
            "layout 'colocate': no node can host " + " and ".join(f"a {r} bundle" for r in paired) + " ("
            + "; ".join(_asks(r, roles[r]) for r in paired) + f"); {_has(nodes)}")
    # as many nodes as the larger role needs, so both line up node by node
    n_nodes = min(len(shared), max(len(roles[r]) for r in paired))
    use = shared[:n_nodes]
    bundles = [b for r in ("rollout", "train") if roles.get(r) for b in _spread(r, roles[r], use)]
    if "draft" in roles:
        bundles.append(Bundle("draft", 0, dict(roles["draft"][0]), use[0].node_id))
    _check_gpu_pairing(roles, use, bundles)
    for n in use:
        on = [b for b in bundles if b.node_id == n.node_id]
        for key, have in (("CPU", n.cpus), ("GPU", n.gpus)):
            asked = sum(b.resources.get(key, 0.0) for b in on)
            if asked > have + _EPS:
                parts = ", ".join(f"{r} {sum(b.resources.get(key, 0.0) for b in on if b.role == r):g}"
                                  for r in ROLES if any(b.role == r for b in on))
                raise ClusterFitError(
                    f"layout 'colocate': the roles sharing node {n.node_id[:8]} ask {asked:g} {key}s "
                    f"({parts}); it has {have:g} ({n.describe()}). Lower the roles' {key} "
                    f"fractions or add nodes.")
    cores = {role: {n.node_id: list(n.cores) for n in use if n.gpus == 0} for role in roles}
    return PlacementPlan("colocate", list(nodes), bundles, cores)


PAIRING_EXAMPLE = "rollout.num_gpus_per_replica=0.6 train.num_gpus_per_worker=0.3 draft.num_gpus=0.1"


def _check_gpu_pairing(roles: dict[str, list[dict[str, float]]], use: list[NodeInfo],
                       bundles: list[Bundle]) -> None:
    """Colocated on GPUs, Ray's best fit (module doc) pairs one replica and
    one Train rank per device exactly when, with shares r (replica), t
    (Train worker) and d (DraftTrainer, 0 off the GPUs):

    - r > 1/2: no device takes two replicas, so each replica gets its own;
    - r + t + d <= 1: a Train rank (and the DraftTrainer) fits beside a replica;
    - 2t > 1 - r: no device takes two Train ranks, so each joins the replica
      device with the least room;
    - per node, no more Train workers than replicas, and no more replicas
      than GPUs.

    Raises:
        ClusterFitError: naming the keys, the shares and an example that pairs.
    """
    if not (roles.get("rollout") and roles.get("train")):
        return  # a replan that moves one of the two: the other's devices hold their pairing already
    r, t = (roles[role][0].get("GPU", 0.0) for role in ("rollout", "train"))
    d = roles["draft"][0].get("GPU", 0.0) if "draft" in roles else 0.0
    if not (r and t) or (r >= 1 and t >= 1):
        return  # at most one of the two on GPUs, or whole devices each: no device is shared
    why = []
    if not r > 0.5:
        why.append(f"rollout.num_gpus_per_replica={r:g} must be > 0.5 (else a device takes two replicas)")
    if r + t + d > 1 + _EPS:
        why.append(f"the shares of one device add up to {r + t + d:g} > 1 (replica {r:g} + Train worker "
                   f"{t:g} + DraftTrainer {d:g})")
    if not 2 * t > 1 - r:
        why.append(f"train.num_gpus_per_worker={t:g} must be > (1 - {r:g}) / 2 (else a device takes two Train ranks)")
    for n in use:
        reps, workers = (sum(b.node_id == n.node_id and b.role == role for b in bundles)
                         for role in ("rollout", "train"))
        if workers > reps:
            why.append(f"node {n.node_id[:8]} gets {workers} Train workers but {reps} replicas "
                       "(a Train rank without a replica's device would share another's)")
        if reps > n.gpus:
            why.append(f"node {n.node_id[:8]} gets {reps} replicas but has {n.gpus:g} GPUs")
    if why:
        raise ClusterFitError("layout 'colocate' on GPUs puts one rollout replica and one Train worker on "
                              "each device, with Ray's fractional GPUs: " + "; ".join(why)
                              + f". For example: {PAIRING_EXAMPLE}")


def check_device_sharing(layout: str, occupants: dict[str, list[tuple[str, str | None]]]) -> str:
    """Check which role landed on which GPU against what ``layout`` promises:
    no device holds two replicas or two Train ranks, and colocated, every
    Train rank's device holds a replica.

    Args:
        layout: ``colocate`` | ``split``.
        occupants: per role, one (node id, physical GPU id or None) per
            replica / Train rank / DraftTrainer (``assigned_gpu``).

    Returns:
        The device table for the log: one line per (node, GPU) with its
        occupants (empty when no role has a GPU).

    Raises:
        ClusterFitError: naming the device and its occupants.
    """
    per_dev: dict[tuple[str, str], list[str]] = {}
    for role in ROLES:
        for i, (node, gpu) in enumerate(occupants.get(role, [])):
            if gpu is not None:
                per_dev.setdefault((node, gpu), []).append(f"{role} {i}")
    table = "\n".join(f"  node {node[:8]} GPU {gpu}: {', '.join(who)}"
                      for (node, gpu), who in sorted(per_dev.items()))
    for (node, gpu), who in sorted(per_dev.items()):
        count = collections.Counter(w.split()[0] for w in who)
        bad = [f"{count[r]} {r} processes" for r in ("rollout", "train") if count[r] > 1]
        if layout == "colocate" and count["train"] and not count["rollout"]:
            bad.append("a Train rank without a replica")
        if layout == "split" and count["train"] and count["rollout"]:
            bad.append("a replica and a Train rank")
        if bad:
            raise ClusterFitError(f"layout '{layout}': node {node[:8]} GPU {gpu} holds {' and '.join(bad)} "
                                  f"({', '.join(who)}); the devices:\n{table}")
    return table


def _plan_split(roles: dict[str, list[dict[str, float]]], nodes: list[NodeInfo]) -> PlacementPlan:
    free = {n.node_id: {"CPU": n.cpus, "GPU": n.gpus} for n in nodes}
    rollout = _first_fit("rollout", roles.get("rollout", []), nodes, free)
    if rollout is None:
        raise ClusterFitError(f"layout 'split': {_asks('rollout', roles['rollout'])}; {_has(nodes)}")
    cores: dict[str, dict[str, list[int]]] = {r: {} for r in roles}
    train_side = roles.get("train", []) + roles.get("draft", [])
    # CPU-only nodes: the rollout side takes whole cores; what it leaves
    # (whole cores) is the training side's.
    for n in nodes:
        if n.gpus > 0:
            continue
        on = [b for b in rollout if b.node_id == n.node_id]
        k = math.ceil(sum(b.resources.get("CPU", 0.0) for b in on) - _EPS) if on else 0
        if on:
            cores["rollout"][n.node_id] = list(n.cores[:k])
            free[n.node_id]["CPU"] = float(len(n.cores) - k)
        for r in ("train", "draft"):
            if r in roles and n.cores[k:]:
                cores[r][n.node_id] = list(n.cores[k:])
    # training prefers nodes the rollout does not use, then what is left
    rollout_nodes = {b.node_id for b in rollout}
    order = [n for n in nodes if n.node_id not in rollout_nodes] + \
            [n for n in nodes if n.node_id in rollout_nodes]
    left = {k: sum(v[k] for v in free.values()) for k in ("CPU", "GPU")}
    train = _first_fit("train", roles.get("train", []), order, free)
    draft = _first_fit("draft", roles["draft"], order, free) if "draft" in roles else []
    if train is None or draft is None:
        asks = [_asks(r, roles[r]) for r in ("train", "draft") if roles.get(r)]
        raise ClusterFitError(
            "layout 'split': " + (f"{_asks('rollout', roles['rollout'])} on its own resources, then "
                                   if roles.get("rollout") else "")
            + " and ".join(asks)
            + f" ({_total(train_side, 'CPU'):g} CPUs, {_total(train_side, 'GPU'):g} GPUs) do not fit "
            f"in what is left ({left['CPU']:g} CPUs, {left['GPU']:g} GPUs, "
            f"whole cores on CPU-only nodes); {_has(nodes)}")
    for r, bs in (("train", train), ("draft", draft)):
        used = {b.node_id for b in bs}
        cores[r] = {n: c for n, c in cores.get(r, {}).items() if n in used}
    return PlacementPlan("split", list(nodes), rollout + train + draft, cores)
