"""The ``collective`` transport: the field's dedicated weight-update group
(OpenRLHF's ``vllm_worker_wrap``, NeMo-RL's ``collective`` weight sync,
vLLM's RLHF examples), driven through vLLM 0.32's weight-transfer
interface. Rank 0 of the trainer holds a trainer-side engine
(``WeightTransferTrainerFactory.trainer_init``) and every vLLM worker of
every replica the worker-side engine its replica was built with
(``weight_transfer_config``): vLLM's own ``nccl`` engines between GPUs,
rayspec's ``gloo`` engines (``gloo_engine.py``, registered with vLLM's
factories) on CPUs and between colocated GPUs. A refit is the trainer
engine's ``send_weights``: each replica runs ``start_weight_update`` (or
``start_draft_weight_update``), ``update_weights`` beside rank 0's
broadcast and ``finish_weight_update`` in one call under its lock, so no
rollout meets a model half reloaded. A draft refit leaves out the modules
the drafter shares with the verifier (vLLM gives an EAGLE head the
verifier's embedding, and its output layer where they were equal at start):
the policy refit owns those.

Forming a group, each replica joins once its engine is free (in async mode
after the rollout it is generating), and the rendezvous then blocks in
C++ until every rank is in, for up to ``timeout_s``. A member that dies
before joining would hold the others' engines that long (10 minutes by
default). So members first check in at a barrier in Python
(``JoinBarrier``), where rank 0, watching that every member is still
alive, can tell them to give up; the rendezvous starts only once all are
in: rank 0 binds the group's port then, and the barrier's go carries the
worker-side init info the trainer engine built (a bind that fails aborts
the barrier); each member adds its first rank and calls
``init_weight_transfer_engine``. The group is formed again from the live
replicas. (Rank 0 asks Serve's controller how many replicas run: a replica
answers one call at a time, and each is in its join.)

A replica Serve restarts after a failure is not in the group: it raises
``ReplicaBehind`` at its first rollout, the rollout's shard comes back with
the newest weights as ObjectRefs (``catch_up``: one ``ray.put`` per version,
only on such faults; vLLM's interface has no catch-up of its own), and the
next refit re-forms the group with it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import time
import uuid
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional

import ray
import torch

from rayspec.buckets import plan_buckets, state_dict_nbytes
from rayspec.sync.interfaces import (Refit, RefitHost, WeightReceiver, WeightSender, WeightSyncError, copy_weights,
                                     transfer_round)

log = logging.getLogger(__name__)


class CollectiveSender(WeightSender):
    """Weights through one process group of rank 0 and every vLLM worker
    (see the module docstring). Refits are sent by one background thread, in
    order: a send returns at once, and a replica busy with a rollout (async
    mode) joins the broadcast when its engine is free.

    Args:
        replicas: the rollout deployment's handle.
        backend: ``nccl`` | ``gloo``.
        packed_buffer_size_bytes: bucket size (bytes).
        timeout_s: forming the group (seconds).
        device: rank 0's device (the thread that sends makes it current,
            for nccl).
    """

    name = "collective"

    def __init__(self, replicas, backend: str, packed_buffer_size_bytes: int, timeout_s: float,
                 device: torch.device | str = "cpu"):
        super().__init__(replicas)
        self.backend, self.bucket_bytes, self.timeout_s = backend, packed_buffer_size_bytes, timeout_s
        self.device = torch.device(device)
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rayspec-weight-sync")
        self._waiters = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="rayspec-weight-sync-wait")
        self._engine = None  # the trainer-side weight-transfer engine of the current group
        self._client: _Members | None = None
        self._source = RefitSource(self.device if backend == "nccl" else "cpu")
        self._draft_shared: tuple[str, ...] = ()  # the drafter's modules that are the verifier's (member())
        self._group_id: str | None = None
        self._members: frozenset = frozenset()
        # vLLM's trainer-side engines, imported now: a first import (seconds) between the members'
        # check-in and the barrier's go would run down their wait
        from vllm.distributed.weight_transfer import factory  # noqa: F401

        from rayspec.sync.gloo_engine import register

        register()

    def send(self, target: str, weights: dict[str, torch.Tensor], version: int) -> Refit:
        """Queue ``weights`` (host tensors, or with nccl tensors on
        ``device``: ``DeviceGather``; kept until the next refit of
        ``target`` for replicas that fall behind) for ``target`` on every
        replica; returns at once."""
        self.latest[target] = (version, None)
        self._weights[target] = weights
        future = self._sender.submit(self._send, target, weights, version)
        return Refit(self, future.result, state_dict_nbytes(weights))

    def catch_up(self, refits: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
        """``refits`` with every None payload replaced by the newest weights
        of its target as an ObjectRef (put once per version; newer than the
        entry where a refit was sent since the rollout was), for a replica
        outside the group. Rank 0's device tensors (``DeviceGather``, sync
        mode) still hold that version here: a replica catches up in a
        rollout, which comes before the next update."""
        return self._put_newest(refits)

    def _send(self, target: str, weights: dict[str, torch.Tensor], version: int):
        if self.device.type == "cuda" and self.device.index is not None:
            # a new thread's current device is 0; NCCL's communicator and
            # streams take the current one (Ray Train's may be another)
            torch.cuda.set_device(self.device)
        self._ensure_group()
        if self._engine is None:  # no replica is up: the ones Serve starts catch up
            return [], 0.0, 0.0
        shared = self._draft_shared if target == "draft" else ()
        self._source.weights = {k: v for k, v in weights.items() if not any(f"{s}." in k for s in shared)}
        self._client.round = (target, version, self._group_id)
        if self.device.type == "cuda":
            # device weights (DeviceGather) were written on the default stream; vLLM's packed
            # broadcast reads them on streams of its own without waiting for it
            torch.cuda.default_stream(self.device).synchronize()
        t0 = time.perf_counter()
        try:
            self._engine.send_weights()
        except Exception as e:
            # A member died or failed mid-refit: the group is unusable; the
            # next refit forms a new one. A replica that died is replaced by
            # Serve (its replacement catches up); one that failed is behind.
            self._drop_group()
            outs = self._client.received()
            dead = [o for o in outs if isinstance(o, ray.exceptions.RayActorError)]
            if dead:
                raise dead[0] from e
            raise WeightSyncError(f"{target} refit to version {version} failed in the weight-sync group: "
                                  f"{e}; replicas: {outs}") from e
        # the replicas load each bucket as it lands: the broadcast and the load overlap
        return self._client.received(), time.perf_counter() - t0, 0.0

    def _start(self, call, *args) -> concurrent.futures.Future:
        """Start ``call`` (a ``RolloutClient`` broadcast) on the replicas now;
        the future gives their results, exceptions included. (Serve
        dispatches a broadcast when its results are first asked for, so a
        thread asks.)"""
        response = call(*args)
        return self._waiters.submit(response.results, return_exceptions=True)

    def _ensure_group(self, attempts: int = 3) -> None:
        """Form the group anew unless every live replica is in the current
        one (a replica Serve started since, or a new trainer rank 0 after a
        Train restart, makes a new group). A member that dies while the
        group forms is left out of the next of ``attempts``.

        Raises:
            WeightSyncError: the group did not form within ``timeout_s``.
            ray.exceptions.RayActorError: members kept dying (the refit is
                skipped; the replicas catch up before their next rollout).
        """
        for attempt in range(1, attempts + 1):
            try:
                return self._form_group()
            except ray.exceptions.RayActorError as e:
                if attempt == attempts:
                    raise
                log.warning("weight sync: a replica died while the group formed (%s); forming it again from the "
                            "live replicas (%d/%d)", type(e).__name__, attempt, attempts - 1)
                time.sleep(1.0)  # Serve's handle drops the dead replica

    def _form_group(self) -> None:
        members = self.replicas.weight_sync_members()
        ids = frozenset(m["replica_id"] for m in members)
        if self._engine is not None and ids == self._members and \
                all(m["group_id"] == self._group_id for m in members):
            return
        self._drop_group()
        if not members:
            return
        offsets, world = {}, 1
        for m in sorted(members, key=lambda m: m["replica_id"]):
            offsets[m["replica_id"]] = world
            world += m["num_workers"]
        host, group_id = ray.util.get_node_ip_address(), uuid.uuid4().hex
        barrier = JoinBarrier(host, len(offsets), self.timeout_s)
        where = (f"the weight-sync group at {host} ({self.backend}, {world} ranks: rank 0 and replicas "
                 f"{offsets} at their first rank)")
        joining = self._start(self.replicas.join_weight_sync, host, offsets, world, self.timeout_s, group_id,
                              barrier.port)
        try:
            barrier.wait(lambda: self._alive(ids), where)
        except BaseException:
            joining.result()  # the members have given up (and released their engines)
            raise
        # The group's port is bound (listening) before the go names it, and gloo's store takes the
        # socket over: a port picked free and bound later stayed open for any socket on the host
        # to take (for a rollout, in async mode, where it was picked before the check-in), and
        # with VLLM_PORT set vLLM's get_open_port gave the barrier's own. Binding fails before
        # the go, which the members then hear as an abort, not after 600 s of connecting.
        try:
            listener = listening_socket(host)
        except OSError as e:
            barrier.abort(f"rank 0 could not bind a port on {host}: {e}")
            joining.result()
            raise WeightSyncError(f"{where}: rank 0 could not bind a port on {host}: {e}") from e
        port = listener.getsockname()[1]
        where = where.replace(f"at {host} ", f"at {host}:{port} ", 1)
        client = _Members(self, barrier, joining)
        forming = _in_daemon_thread(trainer_engine, self.backend, host, listener, world, self.bucket_bytes,
                                    self.timeout_s, client, self._source)
        try:
            engine = self._rendezvous(forming, ids, where)
        except ray.exceptions.RayActorError:
            raise
        except Exception as e:
            listener.close()  # where the store did not take it over
            raise WeightSyncError(f"{where} did not form within {self.timeout_s:.0f} s ({type(e).__name__}: {e}); "
                                  f"the replicas said: {joining.result()}") from e
        self._engine, self._client, self._group_id, self._members = engine, client, group_id, ids
        self._draft_shared = tuple(members[0].get("draft_shared", ()))
        log.info("weight sync: %s group of %d ranks formed at %s:%d (replicas %s)", self.backend, world,
                 host, port, sorted(offsets))

    def _rendezvous(self, forming: concurrent.futures.Future, ids: frozenset, where: str, poll_s: float = 0.5):
        """The trainer engine once every member joined the rendezvous. A
        member that died after the barrier's go (its node, say) would hold
        rank 0 there for ``timeout_s``: rank 0 leaves the rendezvous to its
        thread (it gives up at its timeout) and raises, and the group forms
        again from the live replicas (``_ensure_group``). A live member
        already in that rendezvous waits out its timeout too (vLLM's
        rendezvous has no abort), its engine locked.

        Raises:
            ray.exceptions.ActorDiedError: Serve runs fewer replicas than joined.
        """
        while True:
            try:
                return forming.result(timeout=poll_s)
            except concurrent.futures.TimeoutError:
                if not self._alive(ids):
                    log.warning("weight sync: a replica died in the rendezvous of %s; leaving it", where)
                    raise ray.exceptions.ActorDiedError() from None

    def _alive(self, ids: frozenset) -> bool:
        """Whether Serve still runs as many replicas as ``ids`` (a dead one's
        replacement takes tens of seconds to start; the barrier polls
        every 0.5 s)."""
        return self.replicas.running_replicas() >= len(ids)

    def _drop_group(self) -> None:
        engine, self._engine, self._group_id = self._engine, None, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as e:  # a member is gone; nothing to flush
                log.debug("weight-sync group shutdown: %s", e)

    def close(self) -> None:
        """Stop the sender (after the refits queued) and leave the group."""
        self._sender.shutdown(wait=True)
        self._waiters.shutdown(wait=False)
        self._drop_group()


class RefitSource:
    """The refit in flight as vLLM's ``WeightSource`` (what a trainer-side
    engine sends; the two methods its engines call, without importing vLLM
    into every Train rank): ``weights`` ({name: tensor}, set before each
    ``send_weights``) in order, tensors that share storage (tied
    embeddings) once, under their first name (vLLM ties them itself), each
    on ``device``, where the engine's wire reads it: rank 0's GPU for nccl
    (a host tensor, the draft head's or a host gather's, is copied there as
    it is sent), host memory for gloo.

    Args:
        device: where the engine reads the tensors from.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.weights: dict[str, torch.Tensor] = {}

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, self.weights[name].dtype, tuple(self.weights[name].shape)) for name in self._names()]

    def __iter__(self):
        return ((name, self.weights[name].to(self.device)) for name in self._names())

    def _names(self) -> list[str]:
        return [name for bucket in plan_buckets(self.weights, 1 << 62) for name, _, _ in bucket]


def _in_daemon_thread(fn: Callable, *args) -> concurrent.futures.Future:
    """``fn(*args)`` in a daemon thread of its own: one that may be left
    blocked (a pool's threads are joined when the process exits)."""
    import threading

    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="rayspec-weight-sync-rendezvous", daemon=True).start()
    return future


def trainer_engine(backend: str, host: str, listener: socket.socket, world_size: int, bucket_bytes: int,
                   timeout_s: float, client, source: RefitSource):
    """Rank 0's trainer-side weight-transfer engine of a new group
    (``WeightTransferTrainerFactory.trainer_init``, vLLM 0.32): rayspec's
    ``gloo`` (its store takes ``listener`` over) or vLLM's ``nccl`` (its
    store binds the port itself, so ``listener`` is closed just before:
    vLLM's NCCL rendezvous takes no socket). Blocks until the workers have
    joined (``client.init_weight_transfer_engine``)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rayspec.sync.gloo_engine import GlooTrainerInitInfo

    port = listener.getsockname()[1]
    if backend == "gloo":
        info = GlooTrainerInitInfo(rank=0, master_address=host, master_port=port, world_size=world_size,
                                   packed_buffer_size_bytes=bucket_bytes, timeout_s=timeout_s,
                                   listen_socket=listener)
    else:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        listener.close()
        info = NCCLTrainerInitInfo(rank=0, master_address=host, master_port=port, world_size=world_size,
                                   packed=True, packed_buffer_size_bytes=bucket_bytes)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


class _Members:
    """vLLM's ``VLLMWeightSyncClient`` over the group's replicas, for the
    trainer-side engine: ``init_weight_transfer_engine`` is the barrier's go
    (each member adds its first rank to the info and joins); each replica
    runs a refit's start, update and finish in its one ``receive_weights``
    call (under its lock), so ``update_weights`` carries the round and
    ``start`` / ``finish`` have nothing left to do.

    Attributes:
        round: (target, version, group id) of the refit being sent.
    """

    def __init__(self, sender: CollectiveSender, barrier: "JoinBarrier", joining: concurrent.futures.Future):
        self.sender, self.barrier, self.joining = sender, barrier, joining
        self.round: tuple[str, int, str] | None = None
        self._receiving: concurrent.futures.Future | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.barrier.go(init_info)
        _raise_first(self.joining.result())

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        target, version, group_id = self.round
        self._receiving = self.sender._start(self.sender.replicas.receive_weights, target, update_info, version,
                                             group_id)
        _raise_first(self._receiving.result())

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass

    def received(self) -> list:
        """The replicas' results of the last round (exceptions included)."""
        return [] if self._receiving is None else self._receiving.result()


class DeviceGather:
    """The collective's weight source where rank 0 computes on a GPU and
    NCCL carries the refit: rank 0's full policy on its device, broadcast
    from there (NCCL reads device memory), where ``HostGather`` copies it
    to host memory and the sender copies each bucket back (two PCIe
    crossings of every byte; vLLM's RLHF examples, NeMo-RL and OpenRLHF
    broadcast from the trainer's GPU too). The sender copies the weights to
    host memory only for a replica that catches up (``catch_up``).

    Sync mode only (``make_source``): the module's own tensors go as they
    are (persistent, already in the serving dtype), as nothing writes them
    before the refit has landed and the next rollout has run (a replica
    catches up in a rollout, so they still hold the version it needs). In
    async mode the next update runs while the refit travels: a snapshot
    would hold a second copy of the policy on rank 0's device through it,
    so async runs gather to host (``HostGather``), off the step's critical
    path there. A tensor is copied where its dtype is not the serving one.
    On a CPU (gloo) the same code sends from host memory.

    Args:
        ranks: this rank among the Train workers (``rayspec.train.ranks.Ranks``).

    Attributes:
        reads_device: True: the sender reads rank 0's device memory.
    """

    reads_device = True

    def __init__(self, ranks):
        self.ranks = ranks

    def collect(self, weights: Iterable[tuple[str, torch.Tensor, bool]],
                dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """``weights`` (this rank's full policy on its device, (name, tensor,
        persistent): ``rayspec.train.policy.full_parameters``; a tensor not
        persistent is freed after it is iterated, so it is copied; iterated
        on every rank) in ``dtype`` (floating point ones) on rank 0, on its
        device; None elsewhere. Tied tensors stay one (sent once)."""
        def own_or_copy(t: torch.Tensor, persistent: bool) -> torch.Tensor:
            want = dtype if t.is_floating_point() else t.dtype
            return t.detach() if persistent and t.dtype == want else t.detach().to(want, copy=True)

        return copy_weights(weights, own_or_copy, self.ranks.is_driver)

    def done(self) -> None:
        """Nothing to drop: the sender owns what it sends."""


class JoinBarrier:
    """Rank 0's side of the check-in before the weight-sync rendezvous (see
    the module docstring): a ``torch.distributed.TCPStore`` (what the
    rendezvous itself runs on) that members add themselves to
    (``check_in``) and then poll for ``go`` or ``abort``.

    Args:
        host: rank 0's address the members reach.
        members: replicas expected.
        timeout_s: how long members may take to check in (seconds).
    """

    def __init__(self, host: str, members: int, timeout_s: float):
        from torch.distributed import TCPStore

        listener = listening_socket(host)
        self.port, self.members, self.timeout_s = listener.getsockname()[1], members, timeout_s
        fd = listener.detach()
        try:
            self.store = TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)
        except BaseException:
            socket.close(fd)
            raise

    def wait(self, alive: Callable[[], bool], where: str, poll_s: float = 0.5) -> None:
        """Return once every member has checked in (``go`` then tells them
        the group's port).

        Raises:
            ray.exceptions.ActorDiedError: ``alive()`` said a member died
                (the others are told to give up).
            WeightSyncError: not all checked in within ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        while (arrived := self.store.add("arrived", 0)) < self.members:
            if not alive():
                self.abort("a member died")
                raise ray.exceptions.ActorDiedError()
            if time.monotonic() > deadline:
                self.abort("timeout")
                raise WeightSyncError(f"{where} did not form within {self.timeout_s:.0f} s: {arrived} of "
                                      f"{self.members} replicas checked in")
            time.sleep(poll_s)

    def go(self, init_info: dict[str, Any]) -> None:
        """Tell the members that checked in to join the group: ``init_info``
        is the worker-side init info of the trainer engine (JSON), each
        member's first rank still to be added."""
        self.store.set("go", json.dumps(init_info))

    def abort(self, why: str) -> None:
        """Tell the members to give up (``check_in`` raises, naming ``why``)."""
        self.store.set("abort", why)


def listening_socket(host: str) -> socket.socket:
    """A TCP socket bound to a free port of ``host`` and listening, as vLLM
    binds its DP group's (``ParallelConfig._pick_stateless_dp_port``): the
    port is held from the moment it is picked, so no other socket can take
    it before the store does (``JoinBarrier``, ``engine_access.stateless_group``);
    connections made meanwhile wait in its backlog.

    Raises:
        OSError: no port could be bound.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        s.listen()
    except OSError:
        s.close()
        raise
    return s


def check_in(host: str, port: int, timeout_s: float, replica_id: str, poll_s: float = 0.05) -> dict[str, Any]:
    """A member's side of ``JoinBarrier``: check in, then wait for rank 0's
    ``go``. Returns the worker-side init info it carries.

    Raises:
        WeightSyncError: rank 0 said to give up (a member died, or not all
            checked in in time), it is gone, or no word came within
            ``timeout_s``.
    """
    from torch.distributed import TCPStore

    try:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        store.add("arrived", 1)
        deadline = time.monotonic() + timeout_s
        while not store.check(["go"]):
            if store.check(["abort"]):
                raise WeightSyncError(f"replica {replica_id}: the weight-sync group at {host} was abandoned "
                                      f"({store.get('abort').decode()})")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"replica {replica_id}: no word from the trainer at {host}:{port} "
                                      f"within {timeout_s:.0f} s")
            time.sleep(poll_s)
        return json.loads(store.get("go"))
    except WeightSyncError:
        raise
    except Exception as e:  # rank 0 (the store's server) is gone
        raise WeightSyncError(f"replica {replica_id}: the trainer's check-in at {host}:{port} failed: "
                              f"{type(e).__name__}: {e}") from None


def _raise_first(results: list) -> list:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class CollectiveReceiver(WeightReceiver):
    """A replica's side: its workers join the trainer's weight-sync group
    through vLLM's ``init_weight_transfer_engine`` and load each refit
    through ``start_weight_update`` / ``start_draft_weight_update``,
    ``update_weights`` and ``finish_weight_update`` (``collective_rpc``
    to the workers' methods of vLLM 0.32, ``vllm/v1/worker/gpu_worker.py``).

    Attributes:
        group_id: the group this replica's workers are in, or None.
    """

    def __init__(self, host: RefitHost):
        super().__init__(host)
        self.group_id: Optional[str] = None

    def member(self, num_workers: int, draft_shared: tuple[str, ...]) -> dict[str, Any]:
        """{"replica_id", "group_id", "num_workers" (ranks it takes),
        "draft_shared" (the drafter's modules that are the verifier's, which
        a draft refit leaves out)}."""
        return {"replica_id": self.host.replica_id, "group_id": self.group_id, "num_workers": num_workers,
                "draft_shared": list(draft_shared)}

    def join(self, host: str, rank_offsets: dict[str, int], world_size: int, timeout_s: float, group_id: str,
             barrier_port: int) -> Optional[int]:
        """Check in at rank 0's ``JoinBarrier`` (``barrier_port``), then every
        worker joins the group with the init info the barrier's go carries,
        from rank ``rank_offsets[replica_id]`` (run under the engine's lock).
        Returns that rank, or None where this replica is not in
        ``rank_offsets`` (it started after the trainer counted the replicas;
        it catches up and joins the next group).

        Raises:
            WeightSyncError: the group did not form, or was abandoned
                (names this replica and the address).
        """
        offset = rank_offsets.get(self.host.replica_id)
        if offset is None:
            return None
        self.group_id = None
        init_info = {**check_in(host, barrier_port, timeout_s, self.host.replica_id), "rank_offset": offset}
        try:
            self.host.llm.init_weight_transfer_engine(init_info)
        except Exception as e:
            raise WeightSyncError(f"replica {self.host.replica_id} could not join the weight-sync group at "
                                  f"{host}:{init_info.get('master_port')} as rank {offset} of {world_size}: "
                                  f"{type(e).__name__}: {e}") from None
        self.group_id = group_id
        return offset

    def receive(self, target: str, update_info: dict[str, Any], version: int, group_id: str) -> Optional[int]:
        """Receive ``target``'s weights as the trainer engine broadcasts them
        in the group ``group_id`` (``update_info``: the engine's, e.g. the
        gloo engine's buckets), loading them in place as they arrive.
        Returns the new version, or None where this replica is not in that
        group (it started since; it catches up before its first rollout).

        Raises:
            Whatever the broadcast or the loader raised; the replica then
            keeps its old version (and catches up before its next rollout).
        """
        if group_id != self.group_id:
            return None
        engine = self.host.llm  # vLLM's weight-transfer calls (rayspec.vllm.engines)

        def load():
            try:
                transfer_round(engine, target, update_info)
            except Exception:
                self.group_id = None  # the group is broken: the next refit forms another
                raise

        return self.host.load_refit(target, version, load)
