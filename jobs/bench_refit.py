"""Weight-sync benchmark: one refit through each transport, by state-dict size
and replica count.

    python -m jobs.bench_refit [--quick] [--sizes-gb 0.1 0.5 1 2] [--replicas 1 2]
        [--rounds 2] [--out bench_refit.json] [--run-dir runs/bench_refit]

For each size the bench writes a random Llama (SmolLM2's vocabulary and
tokenizer, width and depth scaled so its fp32 state dict has that many
bytes), starts the rollout deployment (``rollout.num_replicas`` plain vLLM
replicas, as the main job does) on an embedded Ray cluster, and times
``transport.send(...).results()`` from this process, which plays the
trainer's rank 0 (it holds the host state dict, as rank 0 does after the
gather): ``object_store``, ``collective`` (gloo) and ``shared_memory``, in
rounds whose order alternates (o c s s c o ...). Not ``cuda_ipc``: a
replica's workers hold one weight-transfer engine (``gloo`` here, the
collective's), and cuda_ipc's is another (vLLM's ``ipc`` on GPUs, its CPU
twin ``cpu_ipc``); on a CPU its twin's wire is a mapped file in /dev/shm,
as shared_memory's, so it would time nothing of CUDA IPC (that is
``jobs.gpu_smoke``'s ``cuda_ipc refit`` line). Per cell it reports the
seconds of each round, GB/s (state-dict bytes / median seconds) and the
peak extra host memory of a replica during the refit (resident memory of
its process tree above its level before the refit, plus the staging file
under /dev/shm; an upper bound, as the file's mapped pages count in both).
The sender's side (the object store's put, the shared-memory files: one
state dict each, whatever the replica count) is not in that figure. A transport whose
refit fails (a replica killed by Ray's memory monitor, say) is recorded
with its error and the bench goes on. Prints a table, writes JSON (after
every cell) (a list of cells: transport, bytes, replicas, seconds,
gb_per_s, peak_host_bytes, ...) and ``<run-dir>/refit.png``.

``--quick``: 0.1 and 1 GB, one replica (under 10 minutes on 2 cores).

``--across-nodes``: on two simulated nodes of this host
(``rayspec.tools.local_cluster``: host core 0 for the head, where this
process plays rank 0, core 1 for the other; a ``/dev/shm`` each), one
replica, on the head (``same node``) and on the other node (``across
nodes``), in paired rounds (same, across, across, same, ...; each round a
fresh deployment). The nodes share the host's network, so the collective's
TCP is loopback either way; what crosses is the object store (a copy from
the head's store into the other's), and ``shared_memory`` cannot reach the
other node's ``/dev/shm`` (its error is the cell's result).

``--lora-ranks 8 16 64``: a LoRA policy's refit (``rayspec.sync.lora``: the
adapter through the object store, registered as a new vLLM LoRA version)
against the full policy's (the collective, gloo), on the bundled
SmolLM2-135M in fp32 (its real shapes give the adapters' sizes; an adapter
on every linear layer of the decoder blocks, B random). A replica serving
adapters refuses full-weight refits, so each round starts a plain
deployment and a LoRA one (``enable_lora``, ``max_lora_rank`` the largest
rank), in alternating order (plain, LoRA, LoRA, plain, ...); the adapters
of every rank go to the LoRA deployment in one round, in alternating order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import threading
import time
from pathlib import Path

SIZES_GB = (0.1, 0.5, 1.0, 2.0)
QUICK_SIZES_GB = (0.1, 1.0)
TRANSPORTS = ("object_store", "collective", "shared_memory")


def model_for_size(out: Path, tokenizer_dir: Path, nbytes: float) -> Path:
    """A random Llama whose fp32 state dict is about ``nbytes`` (tied
    tensors once): width 256 below 0.3 GB, else 1024; depth to fit."""
    from rayspec.models import make_tiny_llama

    hidden = 256 if nbytes < 0.3e9 else 1024
    vocab = 49152
    per_layer = 10 * hidden * hidden * 4  # q k v o (heads of 64, no GQA) + gate up down (2h)
    layers = max(1, round((nbytes - 2 * vocab * hidden * 4) / per_layer))
    if not (out / "config.json").is_file():
        make_tiny_llama(out, tokenizer_dir, hidden_size=hidden, num_layers=layers)
    return out


class _PeakMemory:
    """Samples a process tree's resident bytes plus a directory's file bytes
    every 20 ms; ``peak`` is the largest excess over the first sample."""

    def __init__(self, pid: int, staging: list[Path]):
        import psutil

        self._proc, self._staging = psutil.Process(pid), staging
        self.baseline = self._sample()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        import psutil

        rss = 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                rss += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        staged = sum(f.stat().st_size for d in self._staging for f in d.glob("*") if f.is_file())
        return rss + staged

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample() - self.baseline)
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._sample() - self.baseline)


def _replica_processes() -> list[int]:
    from ray.util.state import list_actors

    return [a.pid for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True)
            if "SpecVLLMReplica" in a.class_name]


def bench_cell(deploy, sd: dict, replicas: int, rounds: int, bucket_bytes: int) -> list[dict]:
    """Every transport on a fresh deployment (``deploy()`` starts it and
    returns its handle), paired rounds. A transport whose refit fails (e.g.
    a replica killed by Ray's memory monitor) is recorded with its error and
    left out of the later rounds; the deployment is started again for the
    other."""
    from rayspec.rollout.client import RolloutClient
    from rayspec.rollout.engine import SpecVLLMEngine
    from rayspec.buckets import state_dict_nbytes
    from rayspec.sync import CollectiveSender, ObjectStoreSender, SharedMemorySender

    def start():
        handle = deploy()
        replicas = RolloutClient(handle, 1)
        staging = [Path(d) for d in handle.broadcast(SpecVLLMEngine.staging_dir.__name__).results()]
        return (handle, _replica_processes(), staging,
                {"object_store": ObjectStoreSender(replicas),
                 "collective": CollectiveSender(replicas, "gloo", bucket_bytes, timeout_s=600),
                 "shared_memory": SharedMemorySender(replicas, bucket_bytes)})

    handle, pids, staging, transports = start()
    nbytes = state_dict_nbytes(sd)
    seconds = {t: [] for t in TRANSPORTS}
    peaks = {t: [] for t in TRANSPORTS}
    errors: dict[str, str] = {}
    form_s = None
    order = []
    for r in range(rounds):
        order += list(TRANSPORTS) if r % 2 == 0 else list(reversed(TRANSPORTS))
    for version, name in enumerate(order, start=1):
        if name in errors:
            continue
        try:
            if name == "collective" and form_s is None:  # the first send forms the group: timed apart
                t0 = time.perf_counter()
                transports[name].send("policy", sd, version).results()
                form_s = time.perf_counter() - t0
            meters = [_PeakMemory(pid, staging) for pid in pids]
            t0 = time.perf_counter()
            transports[name].send("policy", sd, version).results()
            seconds[name].append(time.perf_counter() - t0)
            peaks[name].append(max(m.stop() for m in meters))
        except Exception as e:  # noqa: BLE001 - recorded in the results, the bench goes on
            # the message, not Ray's remote traceback around it
            errors[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
            print(f"{nbytes / 1e9:.2f} GB, {replicas} replicas, {name}: FAILED ({errors[name]})", flush=True)
            for t in transports.values():
                t.close()
            handle, pids, staging, transports = start()
            form_s = None
    for t in transports.values():
        t.close()
    cells = []
    for name in TRANSPORTS:
        cell = {"transport": name, "bytes": nbytes, "replicas": replicas, "packed_buffer_size_bytes": bucket_bytes}
        if seconds[name]:
            med = statistics.median(seconds[name])
            cell.update(seconds=med, seconds_rounds=seconds[name], gb_per_s=nbytes / med / 1e9,
                        peak_host_bytes=max(peaks[name]))
        if name == "collective" and form_s is not None:
            cell["group_form_seconds"] = form_s
        if name in errors:
            cell["error"] = errors[name]
        cells.append(cell)
    return cells


def merge_rounds(cells: list[dict]) -> list[dict]:
    """Cells of the same size, replica count, placement and transport from
    rounds run apart (``bench_cell`` once per round) as one: their rounds'
    seconds in order, the median, the largest peak, the first error."""
    merged: dict[tuple, dict] = {}
    for c in cells:
        key = (c["bytes"], c["replicas"], c.get("placement"), c["transport"])
        m = merged.setdefault(key, {k: v for k, v in c.items() if k not in ("seconds", "seconds_rounds", "gb_per_s",
                                                                            "peak_host_bytes", "error")})
        m["seconds_rounds"] = m.get("seconds_rounds", []) + c.get("seconds_rounds", [])
        if "peak_host_bytes" in c:
            m["peak_host_bytes"] = max(m.get("peak_host_bytes", 0), c["peak_host_bytes"])
        if "error" in c:
            m.setdefault("error", c["error"])
    for m in merged.values():
        if m["seconds_rounds"]:
            m["seconds"] = statistics.median(m["seconds_rounds"])
            m["gb_per_s"] = m["bytes"] / m["seconds"] / 1e9
        else:
            del m["seconds_rounds"]
    return list(merged.values())


def format_table(cells: list[dict]) -> str:
    lines = [f"{'GB':>5}{'replicas':>9}  {'placement':<14}{'transport':<15}{'seconds (rounds)':<26}{'GB/s':>7}"
             f"{'peak host GB / replica':>24}{'vs object_store':>25}"]
    by = {(c["bytes"], c["replicas"], c.get("placement"), c["transport"]): c for c in cells}
    for c in cells:
        head = f"{c['bytes'] / 1e9:>5.2f}{c['replicas']:>9}  {c.get('placement') or 'one node':<14}{c['transport']:<15}"
        if "seconds" not in c:
            lines.append(f"{head}failed: {c['error']}")
            continue
        rounds = " ".join(f"{s:.2f}" for s in c["seconds_rounds"]) + (" (then failed)" if "error" in c else "")
        store = by.get((c["bytes"], c["replicas"], c.get("placement"), "object_store"), {})
        ratio = f"{store['seconds'] / c['seconds']:.2f}x faster" \
            if c["transport"] != "object_store" and "seconds" in store else ""
        lines.append(f"{head}{rounds:<26}{c['gb_per_s']:>7.3f}{c['peak_host_bytes'] / 1e9:>24.2f}{ratio:>25}")
    return "\n".join(lines)


def plot(cells: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    series = sorted({(c["replicas"], c.get("placement") or "") for c in cells})
    for name, marker in zip(TRANSPORTS, "os^"):
        for (replicas, placement), style in zip(series, ("-", "--", ":", "-.")):
            pts = sorted(((c["bytes"] / 1e9, c) for c in cells
                          if c["transport"] == name and (c["replicas"], c.get("placement") or "") ==
                          (replicas, placement) and "seconds" in c), key=lambda p: p[0])
            if not pts:
                continue
            label = f"{name}, {replicas} replica{'s' * (replicas > 1)}" + (f", {placement}" if placement else "")
            ax[0].plot([g for g, _ in pts], [c["seconds"] for _, c in pts], marker + style, label=label)
            ax[1].plot([g for g, _ in pts], [c["peak_host_bytes"] / 1e9 for _, c in pts], marker + style,
                       label=label)
    ax[0].set(xlabel="state dict (GB)", ylabel="seconds per refit (median)", title="refit time")
    ax[1].set(xlabel="state dict (GB)", ylabel="GB", title="peak extra host memory per replica")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench_refit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="0.1 and 1 GB, 1 replica")
    ap.add_argument("--sizes-gb", type=float, nargs="+", default=None, help=f"default {SIZES_GB}")
    ap.add_argument("--replicas", type=int, nargs="+", default=None, help="default 1 2")
    ap.add_argument("--rounds", type=int, default=2, help="paired rounds per cell (default 2)")
    ap.add_argument("--packed-buffer-size-bytes", type=int, default=None,
                    help="collective bucket size (default: rollout.weight_sync's)")
    ap.add_argument("--out", default="bench_refit.json", help="JSON results file")
    ap.add_argument("--run-dir", default="runs/bench_refit", help="models and the plot go here")
    ap.add_argument("--across-nodes", action="store_true",
                    help="one replica on this process's node and on another simulated node, paired rounds")
    ap.add_argument("--lora-ranks", type=int, nargs="+", default=None,
                    help="adapter refits of these ranks against the full refit, on the bundled SmolLM2-135M")
    ns = ap.parse_args(argv)
    if ns.lora_ranks:
        return lora_main(ns)
    sizes = ns.sizes_gb or (QUICK_SIZES_GB if ns.quick or ns.across_nodes else SIZES_GB)
    replica_counts = [1] if ns.across_nodes else ns.replicas or ([1] if ns.quick else [1, 2])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    import ray
    import torch
    from ray import serve

    from rayspec.config import load_config
    from rayspec.devices import to_host
    from rayspec.models import load_policy, materialize_bundled_model
    from rayspec.rollout.serve import APP_NAME, deploy_rollout
    from rayspec.driver import init_ray

    root = Path(ns.run_dir).resolve()
    store = int(max(sizes) * 1.6e9) + (1 << 30)
    cfg = load_config(None, ["ray.num_cpus=2", f"ray.object_store_memory={store}",
                             "rollout.speculative_config.method=null", "model.dtype=float32",
                             "rollout.cpu_kvcache_space_gib=1"])
    bucket = ns.packed_buffer_size_bytes or cfg.rollout.weight_sync.packed_buffer_size_bytes
    tokenizer_dir = materialize_bundled_model(Path(cfg.model.cache_dir).expanduser())
    cluster = None
    if ns.across_nodes:
        cluster, placements = _two_nodes(root, store)
    else:
        init_ray(cfg)
        placements = {None: None}
    cells: list[dict] = []
    try:
        for gb in sizes:
            model_dir = model_for_size(root / f"model-{gb:g}gb", tokenizer_dir, gb * 1e9)
            sd = to_host(load_policy(model_dir).state_dict(), torch.float32)
            for replicas in replica_counts:
                run = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_replicas=replicas))
                got = []
                # the placements alternate by round (A B B A): each round a deployment of its own
                for r in range(ns.rounds if ns.across_nodes else 1):
                    for placement, plan in (list(placements.items())[::1 if r % 2 == 0 else -1]):
                        got += [{**c, **({"placement": placement} if placement else {})} for c in bench_cell(
                            lambda: deploy_rollout(run, str(model_dir), None, plan), sd, replicas,
                            1 if ns.across_nodes else ns.rounds, bucket)]
                        serve.delete(APP_NAME)
                got = merge_rounds(got)
                cells += got
                print(format_table(got).split("\n", 1)[1], flush=True)
                Path(ns.out).write_text(json.dumps(cells, indent=2) + "\n")  # what is done survives a crash
            del sd
    finally:
        serve.shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    print(format_table(cells))
    print(f"wrote {ns.out} and {plot(cells, root / 'refit.png')}")
    return 0


def adapter_payload(model_dir: Path, r: int) -> dict:
    """A rank-``r`` adapter on every linear layer of the policy in
    ``model_dir``, B random (a trained adapter's size and shapes), as rank 0
    sends it (``AdapterGather``'s payload, fp32)."""
    import torch

    from rayspec.models import load_policy
    from rayspec.sync import AdapterGather
    from rayspec.train.lora import adapter_config, adapter_parameters, random_adapter
    from rayspec.train.ranks import Ranks

    model = random_adapter(load_policy(model_dir), r, lora_alpha=2 * r, std=0.01, seed=r)
    return AdapterGather(Ranks(0, 1), adapter_config(model)).collect(adapter_parameters(model), torch.float32)


def lora_cells(deploy_plain, deploy_lora, sd: dict, adapters: dict[int, dict], rounds: int,
               bucket_bytes: int) -> list[dict]:
    """The full refit (collective, gloo) on a plain deployment and each
    adapter's refit on a LoRA one, ``rounds`` rounds in alternating order
    (a fresh deployment of each per round); cells as ``bench_cell``'s, the
    adapters' with ``lora_rank``."""
    from ray import serve

    from rayspec.buckets import state_dict_nbytes
    from rayspec.rollout.client import RolloutClient
    from rayspec.rollout.serve import APP_NAME
    from rayspec.sync import AdapterSender, CollectiveSender, ObjectStoreSender

    seconds: dict = {}
    for r in range(rounds):
        for kind in ("full", "lora")[::1 if r % 2 == 0 else -1]:
            replicas = RolloutClient((deploy_plain if kind == "full" else deploy_lora)(), 1)
            if kind == "full":
                sender = CollectiveSender(replicas, "gloo", bucket_bytes, timeout_s=600)
                sender.send("policy", sd, 1).results()  # the first send forms the group: not timed
                sends = [("full", sd)]
            else:
                sender = AdapterSender(replicas, ObjectStoreSender(replicas))
                ranks = sorted(adapters)
                sends = [(rank, adapters[rank]) for rank in (ranks if r % 2 == 0 else ranks[::-1])]
            for version, (key, weights) in enumerate(sends, start=2):
                t0 = time.perf_counter()
                sender.send("policy", weights, version).results()
                seconds.setdefault(key, []).append(time.perf_counter() - t0)
            sender.close()
            serve.delete(APP_NAME)
    cells = []
    for key, rounds_s in seconds.items():
        nbytes = state_dict_nbytes(sd if key == "full" else adapters[key]["tensors"])
        med = statistics.median(rounds_s)
        cells.append({"transport": "collective" if key == "full" else "lora_adapter", "bytes": nbytes, "replicas": 1,
                      **({} if key == "full" else {"lora_rank": key}), "seconds": med, "seconds_rounds": rounds_s,
                      "gb_per_s": nbytes / med / 1e9})
    return cells


def format_lora_table(cells: list[dict]) -> str:
    full = next(c for c in cells if c["transport"] == "collective")
    lines = [f"{'refit':<18}{'MB':>9}{'seconds (rounds)':>28}{'vs full, bytes':>16}{'vs full, seconds':>18}"]
    for c in sorted(cells, key=lambda c: c.get("lora_rank", 10**9)):
        name = f"adapter r={c['lora_rank']}" if "lora_rank" in c else "full (collective)"
        rounds = " ".join(f"{s:.3f}" for s in c["seconds_rounds"])
        lines.append(f"{name:<18}{c['bytes'] / 1e6:>9.2f}{rounds:>28}{c['bytes'] / full['bytes']:>16.4f}"
                     f"{c['seconds'] / full['seconds']:>18.3f}")
    return "\n".join(lines)


def lora_main(ns) -> int:
    """``--lora-ranks``: adapter refits against the full refit (module docstring)."""
    import ray
    import torch
    from ray import serve

    from rayspec.config import load_config
    from rayspec.devices import to_host
    from rayspec.driver import init_ray
    from rayspec.models import load_policy, materialize_bundled_model
    from rayspec.rollout.serve import deploy_rollout

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    root = Path(ns.run_dir).resolve()
    common = ["ray.num_cpus=2", "rollout.speculative_config.method=null", "model.dtype=float32",
              "rollout.cpu_kvcache_space_gib=1"]
    plain = load_config(None, common)
    lora = load_config(None, common + ["train.lora.enabled=true", f"train.lora.r={max(ns.lora_ranks)}"])
    bucket = ns.packed_buffer_size_bytes or plain.rollout.weight_sync.packed_buffer_size_bytes
    model_dir = materialize_bundled_model(Path(plain.model.cache_dir).expanduser())
    sd = to_host(load_policy(model_dir).state_dict(), torch.float32)
    adapters = {r: adapter_payload(model_dir, r) for r in ns.lora_ranks}
    init_ray(plain)
    try:
        cells = lora_cells(lambda: deploy_rollout(plain, str(model_dir), None),
                           lambda: deploy_rollout(lora, str(model_dir), None), sd, adapters, ns.rounds, bucket)
    finally:
        serve.shutdown()
        ray.shutdown()
    Path(ns.out).write_text(json.dumps(cells, indent=2) + "\n")
    print(format_lora_table(cells))
    print(f"wrote {ns.out} and {plot_lora(cells, root / 'refit_lora.png')}")
    return 0


def plot_lora(cells: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted(cells, key=lambda c: c.get("lora_rank", 10**9))
    names = [f"r={c['lora_rank']}" if "lora_rank" in c else "full" for c in cells]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    ax[0].bar(names, [c["bytes"] / 1e6 for c in cells])
    ax[0].set(ylabel="MB per refit", yscale="log", title="bytes")
    ax[1].bar(names, [c["seconds"] for c in cells])
    ax[1].set(ylabel="seconds per refit (median)", title="time (1 replica)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _two_nodes(root: Path, store: int):
    """A cluster of two simulated nodes, this process on the first (host
    core 0, where it plays rank 0), joined; returns it and {placement: a
    plan putting one replica on that node}."""
    import os

    import ray

    from rayspec.driver import NAMESPACE
    from rayspec.scheduler.placement import Bundle, PlacementPlan, cluster_nodes
    from rayspec.tools.local_cluster import LocalCluster, NodeSpec

    cluster = LocalCluster(root / "nodes", NodeSpec(1, (0,), store), dashboard=True)  # list_actors: the pids
    other = cluster.add_node(NodeSpec(1, (1,), store))
    os.sched_setaffinity(0, {0})
    ray.init(address=cluster.address, namespace=NAMESPACE)
    nodes = cluster_nodes()
    here = nodes[0].node_id

    def on(node: str) -> PlacementPlan:
        info = next(n for n in nodes if n.node_id == node)
        return PlacementPlan("split", nodes, [Bundle("rollout", 0, {"CPU": 0.5}, node)],
                             {"rollout": {node: list(info.cores)}})

    return cluster, {"same node": on(here), "across nodes": on(other)}


if __name__ == "__main__":
    sys.exit(main())
