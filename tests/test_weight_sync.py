"""The weight transports' own mechanics (rayspec.sync): bucketing, the
group that cannot form, the automatic fallback. The collective refit into a
real vLLM engine is in test_refit.py (policy, after a DeepSpeed step) and
test_draft.py (a trained head); through Serve in the fault
tests."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import ray
import torch

from rayspec.buckets import bucket_nbytes, pack_bucket, plan_buckets, state_dict_nbytes, unpack_bucket
from rayspec.config import ConfigError, load_config
from rayspec.rollout.client import RolloutClient
from rayspec.sync import (CollectiveSender, DeviceExport, DeviceGather, HostGather, IpcWeights, WeightSyncError,
                          make_sender, make_source)
from rayspec.sync.interfaces import resident
from rayspec.train.ranks import Ranks


def _state_dict():
    torch.manual_seed(0)
    embed = torch.randn(50, 8)
    return {"model.embed_tokens.weight": embed,
            "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, dtype=torch.bfloat16),
            "model.layers.0.input_layernorm.weight": torch.randn(8),
            "model.norm.weight": torch.randn(8, dtype=torch.float16),
            "lm_head.weight": embed}  # tied: the same storage


def test_buckets_round_trip_bounded_and_send_tied_weights_once():
    sd = _state_dict()
    buckets = plan_buckets(sd, packed_buffer_size_bytes=300)
    names = [n for b in buckets for n, _, _ in b]
    assert names == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                     "model.layers.0.input_layernorm.weight", "model.norm.weight"]
    # the 1600-byte embedding goes alone; the rest share buckets of <= 300 bytes
    assert [bucket_nbytes(b) for b in buckets] == [1600, 256 + 32, 16]
    assert state_dict_nbytes(sd) == 1600 + 256 + 32 + 16
    for bucket in buckets:
        buffer = pack_bucket(sd, bucket)
        assert buffer.dtype == torch.uint8 and buffer.numel() == bucket_nbytes(bucket)
        for name, t in unpack_bucket(buffer.clone(), bucket):
            assert t.dtype == sd[name].dtype and torch.equal(t, sd[name]), name


def test_a_refit_source_gives_each_tensor_once_on_the_wire_device():
    """The trainer engine's source: tied tensors once, each tensor on the
    device the engine's wire reads (rank 0's GPU for nccl, stood in for by
    the meta device: host weights, such as the draft head's, are moved
    there as they are sent), metadata as iterated."""
    from rayspec.sync.collective import RefitSource

    source = RefitSource("meta")
    source.weights = _state_dict()
    sent = list(source)
    assert [n for n, _ in sent] == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                                    "model.layers.0.input_layernorm.weight", "model.norm.weight"]
    assert all(t.device.type == "meta" for _, t in sent)
    assert [(m.name, m.dtype, m.shape) for m in source.metadata()] == [(n, t.dtype, tuple(t.shape)) for n, t in sent]
    assert all(t.device.type == "cpu" for t in source.weights.values())  # the sender's copies stay where they are


def test_integer_maps_unpack_after_odd_sized_tensors():
    """A draft head's int64 d2t / bool t2d packed after a bf16 tensor whose
    size is not a multiple of 8 bytes still comes back (torch refuses a
    misaligned view)."""
    sd = {"norm.weight": torch.randn(3, dtype=torch.bfloat16), "t2d": torch.tensor([True, False, True]),
          "d2t": torch.tensor([2, 5, 9])}
    bucket, = plan_buckets(sd, 1 << 20)
    for name, t in unpack_bucket(pack_bucket(sd, bucket), bucket):
        assert t.dtype == sd[name].dtype and torch.equal(t, sd[name]), name


class _Replica:
    """A replica that reports itself but never joins the group."""

    def weight_sync_member(self):
        return {"replica_id": "replica-a", "group_id": None, "num_workers": 2}

    def join_weight_sync(self, *args):
        return 1


def _replicas():
    from rayspec.rollout.client import LocalReplicas

    return RolloutClient(LocalReplicas([_Replica()]), 1)


def test_a_group_that_cannot_form_names_the_address_and_the_replica():
    transport = CollectiveSender(_replicas(), "gloo", 1 << 20, timeout_s=2)
    with pytest.raises(WeightSyncError, match=r"weight-sync group at [\d.]+ \(gloo, 3 ranks.*replica-a"):
        transport.send("policy", _state_dict(), 1).results()
    transport.close()


def test_the_group_port_is_bound_before_the_go_names_it_and_a_failed_bind_aborts_the_barrier(monkeypatch):
    """Rank 0 binds the group's port once every member checked in, before the
    go names it, and the group's store takes that socket over: a member
    connects at once, whenever rank 0's rendezvous starts (a port picked
    free and bound later stayed open for any socket on the host to take).
    With ``VLLM_PORT`` set it is not the barrier's (vLLM's ``get_open_port``
    gave both the first free port from it). A bind that fails aborts the
    barrier: the member gives up at once, not after ``timeout_s``."""
    import socket
    import time

    from rayspec.rollout.client import LocalReplicas
    from rayspec.vllm import engine_access
    from rayspec.sync import collective
    from rayspec.sync.collective import check_in

    connected, refused = [], []

    class Replica(_Replica):  # checks in and connects, never joins: rank 0's rendezvous times out
        def join_weight_sync(self, host, offsets, world, timeout_s, group_id, barrier_port):
            try:
                port = check_in(host, barrier_port, timeout_s, "replica-a")["master_port"]
            except WeightSyncError as e:
                refused.append((time.monotonic(), str(e)))
                return e
            with socket.create_connection((host, port), timeout=5):  # refused were it not listening
                connected.append((barrier_port, port))
            return 1

    form = engine_access.stateless_group

    def late(*args, **kwargs):  # rank 0's rendezvous starts only once the member has connected
        deadline = time.monotonic() + 10
        while not connected and time.monotonic() < deadline:
            time.sleep(0.01)
        return form(*args, **kwargs)

    monkeypatch.setattr(engine_access, "stateless_group", late)
    with socket.socket() as s:
        s.bind(("", 0))
        monkeypatch.setenv("VLLM_PORT", str(s.getsockname()[1] + 1))
    transport = CollectiveSender(RolloutClient(LocalReplicas([Replica()]), 1), "gloo", 1 << 20, timeout_s=1)
    with pytest.raises(WeightSyncError, match=r"group at [\d.]+:\d+ \(gloo"):
        transport.send("policy", _state_dict(), 1).results()
    transport.close()
    (barrier_port, group_port), = connected
    assert group_port != barrier_port

    binds = []

    def bind(host):  # the barrier's port binds, the group's does not
        binds.append(host)
        if len(binds) == 2:
            raise OSError(98, "Address already in use")
        return listening_socket(host)

    listening_socket = collective.listening_socket
    monkeypatch.setattr(collective, "listening_socket", bind)
    transport = CollectiveSender(RolloutClient(LocalReplicas([Replica()]), 1), "gloo", 1 << 20, timeout_s=60)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="rank 0 could not bind a port .* Address already in use"):
        transport.send("policy", _state_dict(), 1).results()
    transport.close()
    (when, said), = refused
    assert when - start < 10 and "abandoned (rank 0 could not bind" in said


def test_a_vllm_whose_group_constructor_takes_no_listen_socket_is_refused_by_name(monkeypatch):
    from rayspec.vllm import engine_access
    from rayspec.vllm import touchpoints as tp

    def older(host, port, rank, world_size, backend, group_name=None, return_store=False, timeout=None):
        raise AssertionError("called")

    monkeypatch.setattr(tp.TouchPoint, "load", lambda self: older)
    with pytest.raises(tp.VllmInternalsError, match=r"stateless_init_torch_distributed_process_group takes no "
                                                    r"listen_socket in vLLM \d"):
        engine_access.stateless_group("127.0.0.1", 1, 0, 2, "gloo", 1, listen_socket=object())


def test_transport_choice_and_bad_keys():
    ws = load_config(None, []).rollout.weight_sync
    assert (ws.transport, ws.backend) == ("auto", "auto")
    auto = make_sender(ws, None, trainer_has_gpu=True, replicas_have_gpu=True, device="cpu")
    assert isinstance(auto, CollectiveSender) and auto.backend == "nccl"
    assert make_sender(ws, None, trainer_has_gpu=False, replicas_have_gpu=True).backend == "gloo"
    # colocated, rank 0 and a replica share a GPU: NCCL would refuse the pair
    assert make_sender(ws, None, True, True, shared_gpus=True).backend == "gloo"
    # the object store carries only a restarted replica's catch-up: not a transport to choose
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync\.transport.*object_store.*use collective"):
        load_config(None, ["rollout.weight_sync.transport=object_store"])
    shm = make_sender(load_config(None, ["rollout.weight_sync.transport=shared_memory"]).rollout.weight_sync,
                      None, False, False)
    assert shm.name == "shared_memory" and shm.directory.parent == Path("/dev/shm")
    shm.close()
    assert not shm.directory.exists()
    for override, key in [("rollout.weight_sync.transport=nccl", "rollout.weight_sync.transport"),
                          ("rollout.weight_sync.backend=nccl", "rollout.weight_sync.backend"),
                          ("rollout.weight_sync.timeout_s=0", "rollout.weight_sync.timeout_s"),
                          ("rollout.weight_sync.packed_buffer_size_bytes=1000",
                           "rollout.weight_sync.packed_buffer_size_bytes")]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, [override])
    gpus = ["rollout.weight_sync.backend=nccl", "train.num_gpus_per_worker=1", "rollout.num_gpus_per_replica=1"]
    with pytest.raises(ConfigError, match="NCCL refuses two ranks on one device"):
        load_config(None, [*gpus, "scheduler.layout=colocate"])
    assert load_config(None, [*gpus, "scheduler.layout=split"]).rollout.weight_sync.backend == "nccl"
    ipc = load_config(None, ["rollout.weight_sync.transport=cuda_ipc"]).rollout.weight_sync
    assert make_sender(ipc, None, False, False, shared_gpus=True).name == "cuda_ipc"
    with pytest.raises(ConfigError, match="cuda_ipc needs scheduler.layout=colocate"):
        load_config(None, ["rollout.weight_sync.transport=cuda_ipc", "scheduler.layout=split",
                           "rollout.num_replicas=1"])
    with pytest.raises(ConfigError, match="cuda_ipc needs GPUs on both ends or on neither"):
        load_config(None, ["rollout.weight_sync.transport=cuda_ipc", "rollout.num_gpus_per_replica=0.5"])


def test_the_weight_source_follows_the_transport_the_zero_stage_and_the_mode():
    """``make_source``: the collective sends rank 0's weights where they are
    (NCCL from its GPU; gloo from host memory on CPU ranks, the same code)
    in sync mode; async runs, ZeRO-3, colocated GPUs (gloo) and the object
    store gather to host; cuda_ipc exports on every rank."""
    def source(*overrides, device="cpu"):
        return type(make_source(load_config(None, list(overrides)), Ranks(), device))

    gpus = ["train.num_gpus_per_worker=1", "rollout.num_gpus_per_replica=1"]
    assert source() is DeviceGather  # CPU ranks, auto: the collective over gloo
    assert source(*gpus, "scheduler.layout=split", device="cuda:0") is DeviceGather  # NCCL
    assert source(*gpus, "scheduler.layout=colocate", device="cuda:0") is HostGather  # gloo between GPUs
    assert source("scheduler.mode=async", "scheduler.layout=split", "rollout.num_replicas=1") is HostGather
    assert source("train.deepspeed.zero_optimization.stage=3") is HostGather
    assert source("rollout.weight_sync.transport=shared_memory") is HostGather
    assert source("rollout.weight_sync.transport=cuda_ipc") is DeviceExport


def test_device_gather_sends_the_weights_themselves_and_catches_up_from_host_copies(monkeypatch):
    """``DeviceGather`` on rank 0 gives the module's own tensors where they
    are in the serving dtype, copies the rest (cast, or freed after their
    gather: not persistent), and nothing on the other ranks; the sender
    puts host copies for a replica that catches up, once a version."""
    import ray

    live = _state_dict()
    gathered = torch.randn(3, 3)
    weights = DeviceGather(Ranks()).collect([*resident(live), ("model.layers.1.gathered", gathered, False)],
                                            torch.float32)
    assert weights["model.embed_tokens.weight"] is not live["model.embed_tokens.weight"]  # a detached view
    assert weights["model.embed_tokens.weight"].data_ptr() == live["model.embed_tokens.weight"].data_ptr()
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32  # cast: a copy
    cast = DeviceGather(Ranks()).collect(resident(live), torch.bfloat16)
    assert cast["lm_head.weight"] is cast["model.embed_tokens.weight"]  # tied: one copy
    assert weights["model.layers.1.gathered"].data_ptr() != gathered.data_ptr()
    assert DeviceGather(Ranks(rank=1, world=2)).collect(resident(live), torch.float32) is None

    puts = []
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or "ref")
    transport = CollectiveSender(_replicas(), "gloo", 1 << 20, timeout_s=2)
    transport.latest["policy"], transport._weights["policy"] = (4, None), weights
    assert transport.catch_up({"policy": (3, None)}) == {"policy": (4, "ref")}
    assert transport.catch_up({"policy": (3, None)}) == {"policy": (4, "ref")} and len(puts) == 1  # once a version
    assert all(puts[0][k].data_ptr() != v.data_ptr() and torch.equal(puts[0][k], v) for k, v in weights.items())
    transport.close()


@pytest.mark.slow
def test_tensor_parallel_workers_each_join_and_load_their_shard(tiny_llama_dir):
    """A replica of two tensor-parallel workers takes two ranks of the group
    (1 and 2 after the trainer's 0); each receives the full tensors and its
    weight loaders keep its shard: the refit policy's greedy continuation is
    the trainer's."""
    from rayspec.models import load_policy, load_tokenizer
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env
    from rayspec.rollout.client import LocalReplicas
    from tests.conftest import engine_kwargs

    eng = SpecVLLMEngine(str(tiny_llama_dir), None, dtype="float32", env=cpu_engine_env(1, "0|1"),
                         engine_kwargs=engine_kwargs(tensor_parallel_size=2, distributed_executor_backend="mp"))
    try:
        assert eng.weight_sync_member()["num_workers"] == 2
        probe = load_tokenizer(tiny_llama_dir).encode("Question: what is 12 plus 30? Answer:")
        policy = load_policy(tiny_llama_dir).eval()
        torch.manual_seed(1)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
            want = policy.generate(torch.tensor([probe]), max_new_tokens=16, do_sample=False,
                                   attention_mask=torch.ones(1, len(probe), dtype=torch.long))[0, len(probe):]
        assert eng.generate([probe], temperature=0.0, max_tokens=16)[0].response_ids[0] != want.tolist()
        transport = CollectiveSender(RolloutClient(LocalReplicas([eng]), 1), "gloo", 1 << 20, timeout_s=120)
        assert transport.send("policy", dict(policy.state_dict()), 1).results() == [1]
        transport.close()
        assert eng.generate([probe], temperature=0.0, max_tokens=16)[0].response_ids[0] == want.tolist()
    finally:
        eng.shutdown()


class _Member:
    """A replica of one worker that joins the group for real (gloo) and
    receives refits; ``dies`` makes it die at its join, before checking in,
    as a SIGKILLed replica would (Serve's handle then drops it)."""

    def __init__(self, replica_id: str, engines: list, dies: bool = False):
        self.replica_id, self.engines, self.dies = replica_id, engines, dies
        self.joins: list = []
        self.pg = None

    def weight_sync_member(self):
        return {"replica_id": self.replica_id, "group_id": None, "num_workers": 1}

    def join_weight_sync(self, host, offsets, world, timeout_s, group_id, barrier_port):
        import ray

        from rayspec.vllm import engine_access
        from rayspec.sync.collective import check_in

        if self.dies:
            self.engines.remove(self)
            raise ray.exceptions.ActorDiedError()
        try:
            info = check_in(host, barrier_port, timeout_s, self.replica_id)
        except WeightSyncError as e:
            self.joins.append(str(e))
            raise
        self.pg = engine_access.stateless_group(host, info["master_port"], offsets[self.replica_id], world, "gloo",
                                                timeout_s)
        self.joins.append("joined")
        return offsets[self.replica_id]

    def receive_weights(self, target, update_info, version, group_id):
        self.received = {}
        for bucket in update_info["buckets"]:  # the gloo engine's update info
            buffer = torch.empty(bucket_nbytes(bucket), dtype=torch.uint8)
            self.pg.broadcast(buffer, 0).wait()
            self.received.update(unpack_bucket(buffer, bucket))
        return version


def test_a_replica_dying_while_the_group_forms_does_not_hold_the_others():
    """Replica b dies at its join (as a replica SIGKILLed while the group
    forms). Replica a, waiting at the check-in barrier, is told to give up
    at once rather than after ``timeout_s`` (vLLM's rendezvous would hold
    its engine that long); the group forms again without b, and the refit
    lands in a."""
    import time

    from rayspec.rollout.client import LocalReplicas

    engines: list = []
    a, b = _Member("a", engines), _Member("b", engines, dies=True)
    engines += [a, b]
    transport = CollectiveSender(RolloutClient(LocalReplicas(engines), 2), "gloo", 1 << 20, timeout_s=120)
    t0 = time.monotonic()
    try:
        assert transport.send("policy", _state_dict(), 1).results() == [1]
    finally:
        transport.close()
    assert time.monotonic() - t0 < 30
    assert len(a.joins) == 2 and "abandoned (a member died)" in a.joins[0] and a.joins[1] == "joined"
    for name, t in _state_dict().items():
        if name != "lm_head.weight":  # tied: sent once, as the embedding
            assert torch.equal(a.received[name], t), name


def _join_as_rank_1(host: str, port: int, out) -> None:
    from rayspec.vllm import engine_access

    pg = engine_access.stateless_group(host, port, 1, 2, "gloo", 60)
    t = torch.zeros(4)
    pg.broadcast(t, 0).wait()
    out.put(t.tolist())
    pg.barrier().wait()  # the parent reads its sockets while both ends are up
    pg.barrier().wait()


def _non_loopback_ipv4() -> str | None:
    import socket

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_a_gloo_weight_sync_group_binds_to_the_interface_that_reaches_the_trainer():
    """torch's gloo binds to the address the hostname resolves to, on many
    machines a loopback one (this one's resolves to 127.0.0.1): a replica on
    another node could not connect. The group forms on the interface that
    reaches the rendezvous host (the trainer's Ray node IP) instead: both
    ranks' gloo connections use that address, none loopback."""
    import multiprocessing as mp
    import os

    import psutil

    from rayspec.vllm import engine_access

    host = _non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 interface to bind to")
    assert engine_access.route_interface(host) is not None and engine_access.route_interface("127.0.0.1") == "lo"
    from rayspec.sync.collective import listening_socket

    listener = listening_socket(host)
    port = listener.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_join_as_rank_1, args=(host, port, out))
    child.start()
    try:
        pg = engine_access.stateless_group(host, port, 0, 2, "gloo", 60, listen_socket=listener)
        pg.broadcast(torch.arange(4.0), 0).wait()
        assert out.get(timeout=60) == [0.0, 1.0, 2.0, 3.0]
        pg.barrier().wait()
        # the child's own sockets: the rendezvous store's and its gloo pair's (this process has others)
        conns = [c for c in psutil.Process(child.pid).net_connections(kind="tcp") if c.status == "ESTABLISHED"]
        assert "GLOO_SOCKET_IFNAME" not in os.environ  # set only while the group forms
        pg.barrier().wait()
    finally:
        child.join(timeout=60)
    gloo = [c for c in conns if c.raddr.port != port]  # the rendezvous store's aside
    assert gloo and all(c.laddr.ip == host and c.raddr.ip == host for c in gloo), conns


def test_a_shared_memory_sender_removes_the_files_of_a_killed_predecessor():
    """A rank 0 killed mid-refit leaves its /dev/shm directory (host memory);
    the sender of the restarted worker group removes it, and leaves those of
    live senders (another run on the node, itself)."""
    import os
    import subprocess

    from rayspec.sync import SharedMemorySender
    from rayspec.sync.shared_memory import PREFIX, SHM

    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = Path(SHM) / f"{PREFIX}{dead.pid}-test"
    alive = Path(SHM) / f"{PREFIX}{os.getpid()}-test"
    for d in (orphan, alive):
        d.mkdir()
        (d / "policy-v3.bin").write_bytes(b"\0" * 4096)
    try:
        sender = SharedMemorySender(None, 1 << 20)
        assert not orphan.exists() and alive.exists()
        assert sender.directory.name.startswith(f"{PREFIX}{os.getpid()}-")
        sender.close()
    finally:
        for d in (orphan, alive):
            shutil.rmtree(d, ignore_errors=True)


def test_shared_memory_files_hold_the_packed_buckets_until_the_refit_landed(monkeypatch):
    """The shared_memory sender's files unpack to the state dict (tied
    tensors once), exist while the replicas load and are gone after; a
    refit larger than /dev/shm's free space is refused before any is written."""
    from collections import namedtuple

    from rayspec.sync import SharedMemorySender
    from rayspec.sync import shared_memory as shm_mod

    sd = _state_dict()
    seen = {}

    class Replicas:
        def receive_shared(self, target, files, version):
            for path, bucket in files:
                buffer = torch.from_file(path, shared=False, size=bucket_nbytes(bucket), dtype=torch.uint8)
                seen.update(unpack_bucket(buffer, bucket))
            done = type("Response", (), {"results": lambda self, return_exceptions=False: [version]})()
            seen["paths"] = [p for p, _ in files]
            return done

    sender = SharedMemorySender(Replicas(), packed_buffer_size_bytes=1 << 20)
    try:
        refit = sender.send("policy", sd, 3)
        assert all(Path(p).exists() for p in seen["paths"])  # until results()
        assert refit.results() == [3] and not any(Path(p).exists() for p in seen.pop("paths"))
        assert sorted(seen) == sorted(k for k in sd if k != "lm_head.weight")  # tied: sent once
        assert all(torch.equal(seen[k], sd[k]) for k in seen)
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(shm_mod.shutil, "disk_usage", lambda p: usage(100, 90, 10))
        with pytest.raises(WeightSyncError, match=r"does not fit in /dev/shm \(0\.00 GiB free\)"):
            sender.send("policy", sd, 4)
        assert not list(sender.directory.iterdir())
    finally:
        sender.close()


def test_a_replica_dying_mid_refit_leaves_the_refit_to_the_others_until_they_loaded():
    """A replica that dies during a shared-memory refit does not free the
    files under a survivor still loading them (CI: the survivor lost them
    mid-load and kept a half-reloaded model); the dead replica's error is
    raised after, a live replica's before it."""
    import concurrent.futures

    from rayspec.rollout.client import _Responses
    from rayspec.sync import SharedMemorySender

    pool = concurrent.futures.ThreadPoolExecutor(2)
    loaded = []

    def died():
        raise ray.exceptions.RayActorError()

    def loads(files, error=None):
        time.sleep(0.3)
        loaded.append(all(Path(p).exists() for p, _ in files))
        if error:
            raise error

    class Replicas:
        error = None

        def receive_shared(self, target, files, version):
            return _Responses([pool.submit(died), pool.submit(loads, files, self.error)])

    replicas = Replicas()
    sender = SharedMemorySender(replicas, packed_buffer_size_bytes=1 << 20)
    try:
        with pytest.raises(ray.exceptions.RayActorError):
            sender.send("policy", _state_dict(), 3).results()
        assert loaded == [True]
        replicas.error = WeightSyncError("a live replica's")
        with pytest.raises(WeightSyncError, match="a live replica's"):
            sender.send("policy", _state_dict(), 4).results()
        assert not list(sender.directory.iterdir())
    finally:
        sender.close()
        pool.shutdown()


def _torch_shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"torch_{__import__('os').getpid()}_*")}


def test_a_shared_tensor_opens_in_another_process_again_and_again_until_released():
    """cuda_ipc's CPU twin: a handle made with torch's reductions opens in
    another process (the vLLM worker) as a mapping of the sender's memory,
    as often as replicas open it, one after another (torch's own
    ``rebuild_storage_filename`` gives back the sender's reference at the
    first open: without ``open_shared`` putting it back, the file would be
    gone at the second); the file goes once the sender releases it and
    frees the tensor."""
    import gc
    import subprocess
    import sys

    from rayspec.sync.ipc import release, share, shareable

    before = _torch_shm_files()
    src = torch.randn(300, 40)
    t = shareable(src, torch.bfloat16, copy=False)
    assert t.dtype == torch.bfloat16 and t.is_shared() and torch.equal(t, src.to(torch.bfloat16))
    handle = share(t)
    child = ("import gc, sys, torch\n"
             "from rayspec.sync.ipc import open_shared\n"
             "handle = sys.stdin.buffer.read()\n"
             "for _ in range(3):  # three replicas, each opening once its predecessor let go\n"
             "    x = open_shared(handle)\n"
             "    print(float(x.float().sum()), x.dtype, tuple(x.shape), flush=True)\n"
             "    del x\n"
             "    gc.collect()\n")
    out = subprocess.run([sys.executable, "-c", child], input=handle, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    want = f"{float(t.float().sum())} torch.bfloat16 (300, 40)"
    assert out.stdout.decode().splitlines() == [want] * 3
    assert len(_torch_shm_files() - before) == 1
    release(t)
    del t
    gc.collect()
    assert _torch_shm_files() == before


class _TwoRanks:
    """Rank ``rank`` of two: this rank's side of the collectives, the other
    rank's contributions given (its device key, its handles)."""

    def __init__(self, rank: int, other_key: str, other_handles=None):
        self.rank, self.world, self.barriers = rank, 2, 0
        self.other_key, self.other_handles = other_key, other_handles

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj):
        other = self.other_key if isinstance(obj, str) else self.other_handles
        return [obj, other] if self.rank == 0 else [other, obj]

    def barrier(self):
        self.barriers += 1


def test_every_device_exports_once_and_rank_0_sends_every_handle(monkeypatch):
    """``DeviceExport``: the first rank on each device key exports (tied
    tensors once), rank 0 gets each tensor's handles by key, a rank whose
    key another serves exports nothing and gets None, and every rank meets
    at the barrier before it drops its export; the sender sends only the
    payload (no tensors), and catches a replica up from the host copy."""
    import gc

    from rayspec.sync import CudaIpcSender, DeviceExport, IpcWeights
    from rayspec.sync.interfaces import resident
    from rayspec.sync.ipc import device_key

    sd = _state_dict()
    mine = device_key(torch.device("cpu"))
    before = _torch_shm_files()
    rank0 = DeviceExport(_TwoRanks(0, "gpu-other", other_handles=[b"h0", b"h1", b"h2", b"h3"]), torch.device("cpu"))
    weights = rank0.collect(resident(sd), torch.float32)
    assert isinstance(weights, IpcWeights)
    assert weights.names == [k for k in sd if k != "lm_head.weight"]  # tied: once
    assert weights.dtype_names == ["float32", "float32", "float32", "float32"]  # floating point in the serving dtype
    assert [sorted(h) for h in weights.ipc_handles] == [sorted([mine, "gpu-other"])] * 4
    assert [h["gpu-other"] for h in weights.ipc_handles] == [b"h0", b"h1", b"h2", b"h3"]
    assert weights.nbytes == sum(v.numel() * 4 for k, v in sd.items() if k != "lm_head.weight")
    assert len(_torch_shm_files() - before) == 4

    import subprocess

    from rayspec.sync.ipc import SHM, TORCH_SHM_PREFIX

    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = Path(SHM) / f"{TORCH_SHM_PREFIX}{dead.pid}_123_0"  # a killed rank's export (Ray killed torch's manager)
    orphan.write_bytes(b"\0" * 4096)
    rank1 = DeviceExport(_TwoRanks(1, mine), torch.device("cpu"))  # the same host: rank 0's export serves it
    assert not orphan.exists() and len(_torch_shm_files() - before) == 4  # live ones stay
    assert rank1.collect(resident(sd), torch.float32) is None
    rank1.done()
    assert rank1.ranks.barriers == 1 and len(_torch_shm_files() - before) == 4

    payloads = []

    class Replicas:
        def receive_ipc(self, target, payload, version):
            payloads.append(payload)
            return type("Response", (), {"results": lambda self, return_exceptions=False: [version]})()

    sender = CudaIpcSender(Replicas())
    assert sender.send("policy", weights, 5).results() == [5]
    assert sender.rollout_refits() == {"policy": (5, None)}
    assert set(payloads[0]) == {"names", "dtype_names", "shapes", "ipc_handles"}  # vLLM's IPCWeightTransferUpdateInfo
    rank0.done()
    assert rank0.ranks.barriers == 1
    rank0.done()  # nothing pending: no second barrier
    assert rank0.ranks.barriers == 1
    monkeypatch.setattr("ray.put", lambda x: x)
    refits = sender.catch_up(sender.rollout_refits())
    assert refits["policy"][0] == 5
    assert all(torch.equal(refits["policy"][1][k], sd[k].float()) for k in weights.names)
    del weights, refits
    sender.close()
    gc.collect()
    assert _torch_shm_files() == before  # the host copy was the export: gone with the sender's


def test_a_gpu_export_is_keyed_and_shaped_as_vllms_ipc_engine_reads_it(monkeypatch):
    """On a GPU the payload is what vLLM's own ``ipc`` engine rebuilds from:
    handles keyed by the GPU's UUID (the same device whatever
    CUDA_VISIBLE_DEVICES numbers it), each one ``reduce_tensor``'s arguments
    of ``rebuild_cuda_tensor``. vLLM 0.32's ``IPCWeightTransferEngine``
    parses an ``IpcWeights.payload`` and its ``receive_weights`` rebuilds
    each tensor on the worker's own device index and loads it by name (CUDA
    stood in for: the device's properties, the rebuild, the model)."""
    import contextlib
    import sys
    import types

    import torch.multiprocessing.reductions as reductions
    import vllm.distributed.weight_transfer.ipc_engine as vllm_ipc

    from rayspec.sync import ipc

    props = type("Props", (), {"uuid": "GPU-1234"})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    key = ipc.device_key(torch.device("cuda", 1))
    assert key == "GPU-1234"
    sent = ("Tensor", (3,), (1,), 0, "Storage", "float32", 1, b"handle", 12, 0, False, b"ref", 0, b"event", True)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, sent))
    handle = ipc.share(type("T", (), {"device": torch.device("cuda", 1)})())
    payload = IpcWeights(["w"], ["float32"], [[3]], [{key: handle}], 12).payload

    rebuilt, loaded = [], []
    monkeypatch.setattr(vllm_ipc, "rebuild_cuda_tensor", lambda *args: rebuilt.append(args) or torch.ones(3))
    # its loader's MTP check, which would load vLLM's C++ extension into this process
    mtp = types.ModuleType("mtp_validation")
    mtp.disable_mtp_completeness_check = contextlib.nullcontext
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.mtp_validation", mtp)
    engine = vllm_ipc.IPCWeightTransferEngine.__new__(vllm_ipc.IPCWeightTransferEngine)
    engine.packed, engine.device = False, torch.device("cuda", 2)  # the worker numbers the GPU 2
    engine.model = type("Model", (), {"load_weights": lambda self, w: loaded.extend(w)})()
    engine.receive_weights(engine.parse_update_info(payload))
    (args,) = rebuilt
    assert args[6] == 2 and args[:6] == sent[:6] and args[7:] == sent[7:]
    assert [(n, t.tolist()) for n, t in loaded] == [("w", [1.0, 1.0, 1.0])]
