"""Weight transports: rank 0 of the trainer sends a refit to every replica.

``object_store``: one ``ray.put`` of the host state dict, a Serve broadcast
of its ObjectRef, and each replica reads it and stages it as a safetensors
file for vLLM's loader (``SpecVLLMEngine.update_weights``). Simple, and
right for tiny models; at 16 GB it is three host copies and a TCP transfer
per replica.

``collective``: the field's dedicated weight-update group (OpenRLHF's
``vllm_worker_wrap``, NeMo-RL's ``collective`` weight sync, vLLM's RLHF
examples): rank 0 and every vLLM worker of every replica join one process
group built by vLLM's ``stateless_init_torch_distributed_process_group``
from a TCP rendezvous on rank 0 (no global ``init_process_group`` in the
workers). A refit is a sequence of packed buckets broadcast from rank 0,
each unpacked by the workers straight into vLLM's in-place reload
(``RefitExtension.rayspec_receive_weights``); tensor-parallel workers each
take their shard through the model's weight loaders. The same code runs
NCCL on GPUs and gloo on CPUs; only the backend name and the buffers'
device differ.

Why not vLLM 0.32's own ``weight_transfer`` engines: their dense engine is
PyNccl only (no gloo, CUDA streams in the packed loop), so none of it could
run in CI; rayspec uses vLLM's group constructor and bucket layout instead
and keeps its own receive hook (the draft refit must skip the modules the
head shares with the verifier).

A replica Serve restarts after a failure is not in the group: it raises
``ReplicaBehind`` at its first rollout, the rollout's shard comes back with
the newest weights as ObjectRefs (``catch_up``: one ``ray.put`` per version,
only on such faults), and the next refit re-forms the group with it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
import uuid
from datetime import timedelta
from typing import Any, Callable

import ray
import torch

log = logging.getLogger(__name__)

# replica method per refit target
_UPDATE = {"policy": "update_weights", "draft": "update_draft"}

Bucket = list[tuple[str, str, list[int]]]  # (name, torch dtype name, shape) per tensor


class WeightSyncError(RuntimeError):
    """The weight-sync group could not form, or a refit through it failed."""


def plan_buckets(state_dict: dict[str, torch.Tensor], packed_buffer_size_bytes: int) -> list[Bucket]:
    """Split a state dict into buckets of at most ``packed_buffer_size_bytes``
    (a larger tensor goes alone). Tensors sharing storage (tied embeddings)
    are sent once, under their first name: vLLM ties them itself.

    Returns:
        [[(name, dtype name, shape), ...], ...]: metadata only, what the
        receivers need to size their buffers and unpack.
    """
    buckets: list[Bucket] = [[]]
    size, seen = 0, set()
    for name, t in state_dict.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > packed_buffer_size_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, str(t.dtype).removeprefix("torch."), list(t.shape)))
        size += nbytes
    return [b for b in buckets if b]


def bucket_nbytes(bucket: Bucket) -> int:
    """Bytes of a bucket's packed buffer."""
    return sum(math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape in bucket)


def pack_bucket(state_dict: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor:
    """The bucket's tensors as one flat uint8 buffer [bucket_nbytes], on
    their device, in the bucket's order (vLLM's packed layout: each tensor's
    bytes, contiguous, back to back)."""
    return torch.cat([state_dict[name].contiguous().view(-1).view(torch.uint8) for name, _, _ in bucket])


def unpack_bucket(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a received buffer, the inverse of ``pack_bucket``."""
    sizes = [math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape in bucket]
    out = []
    for (name, dtype, shape), part in zip(bucket, buffer.split(sizes)):
        dt = getattr(torch, dtype)
        if part.storage_offset() % dt.itemsize:  # e.g. an int64 d2t map after an odd-sized bf16 tensor
            part = part.clone()
        out.append((name, part.view(dt).view(shape)))
    return out


def state_dict_nbytes(state_dict: dict[str, torch.Tensor]) -> int:
    """Bytes a refit moves (tied tensors once)."""
    return sum(bucket_nbytes(b) for b in plan_buckets(state_dict, 1 << 62))


class Refit:
    """A refit on its way to every replica. ``results()`` waits until it has
    landed (the pipeline's refit tracking calls it) and returns the replicas'
    results; what it moved and how long it took go to ``transport.take_stats``.

    ``wait`` returns (replica results, transfer seconds, load seconds), or
    raises what a replica raised.
    """

    def __init__(self, transport, wait: Callable[[], tuple[list, float, float]], nbytes: int):
        self._transport, self._wait, self.nbytes = transport, wait, nbytes
        self._results: list | None = None

    def results(self) -> list:
        if self._results is None:
            self._results, transfer_s, load_s = self._wait()
            self._transport._landed.append((self.nbytes, transfer_s, load_s))
        return self._results


class _Transport:
    """What both transports share: the newest weights of each target (for
    replicas that fall behind) and the accounting of landed refits."""

    name = ""

    def __init__(self, replicas):
        self._replicas = replicas
        self.latest: dict[str, tuple[int, Any]] = {}
        self._landed: list[tuple[int, float, float]] = []

    def rollout_refits(self) -> dict[str, tuple[int, Any]]:
        """``refits`` for the next rollout: {target: (version, ObjectRef or
        None)}; a replica behind a None entry raises ``ReplicaBehind``."""
        return dict(self.latest)

    def take_stats(self) -> dict[str, Any]:
        """Step-record keys of the refits landed since the last call:
        ``weight_sync_transport``, ``weight_sync_bytes``,
        ``time_sync_transfer_s``: rank 0 sending (object store: the
        ``ray.put``; collective: the broadcast of every bucket, which the
        replicas load as they land), and ``time_sync_load_s``: after that
        until every replica reports the weights loaded (object store: their
        ``ray.get``, staging file and load; collective: the last bucket's
        load). In async mode that includes waiting behind a rollout."""
        landed, self._landed = self._landed, []
        return {"weight_sync_transport": self.name,
                "weight_sync_bytes": sum(b for b, _, _ in landed),
                "time_sync_transfer_s": sum(t for _, t, _ in landed),
                "time_sync_load_s": sum(t for _, _, t in landed)}

    def close(self) -> None:
        pass


class ObjectStoreTransport(_Transport):
    """Weights through Ray's object store (see the module docstring).

    Args:
        replicas: the rollout deployment's handle (``broadcast(method, *args)``
            returning a response with ``results()``).
    """

    name = "object_store"

    def send(self, target: str, weights: dict[str, torch.Tensor], version: int) -> Refit:
        """Put ``weights`` (host tensors) and broadcast them to ``target``
        (``policy`` | ``draft``) on every replica; returns at once."""
        t0 = time.perf_counter()
        ref = ray.put(weights)
        self.latest[target] = (version, ref)
        response = self._replicas.broadcast(_UPDATE[target], ref, version)
        sent = time.perf_counter()

        def wait():
            out = response.results()
            return out, sent - t0, time.perf_counter() - sent

        return Refit(self, wait, state_dict_nbytes(weights))

    def catch_up(self, refits: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
        return refits  # the ObjectRefs are already there


class CollectiveTransport(_Transport):
    """Weights through one process group of rank 0 and every vLLM worker
    (see the module docstring). Refits are sent by one background thread, in
    order: a send returns at once, and a replica busy with a rollout (async
    mode) joins the broadcast when its engine is free.

    Args:
        replicas: the rollout deployment's handle.
        backend: ``nccl`` | ``gloo``.
        packed_buffer_size_bytes: bucket size (bytes).
        timeout_s: forming the group, and each bucket (seconds).
        device: where rank 0's buckets go before the broadcast (its GPU for
            nccl, ``cpu`` for gloo).
        fallback: where refits go when the group cannot form (``auto``), or
            None to raise WeightSyncError.
    """

    name = "collective"

    def __init__(self, replicas, backend: str, packed_buffer_size_bytes: int, timeout_s: float,
                 device: torch.device | str = "cpu", fallback: ObjectStoreTransport | None = None):
        super().__init__(replicas)
        self.backend, self.bucket_bytes, self.timeout_s = backend, packed_buffer_size_bytes, timeout_s
        self.device, self._fallback = torch.device(device), fallback
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rayspec-weight-sync")
        self._waiters = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="rayspec-weight-sync-wait")
        self._pg = None
        self._group_id: str | None = None
        self._members: frozenset = frozenset()
        self._catch_up_refs: dict[str, tuple[int, Any]] = {}
        self._weights: dict[str, dict[str, torch.Tensor]] = {}
        self._fell_back = False  # the group could not form (auto): the object store from then on

    def send(self, target: str, weights: dict[str, torch.Tensor], version: int) -> Refit:
        """Queue ``weights`` (host tensors; kept until the next refit of
        ``target`` for replicas that fall behind) for ``target`` on every
        replica; returns at once."""
        if self._fell_back:
            refit = self._fallback.send(target, weights, version)
            return Refit(self, refit._wait, refit.nbytes)
        self.latest[target] = (version, None)
        self._weights[target] = weights
        future = self._sender.submit(self._send, target, weights, version)
        return Refit(self, future.result, state_dict_nbytes(weights))

    def catch_up(self, refits: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
        """``refits`` with every None payload replaced by the newest weights
        of its target as an ObjectRef (put once per version; newer than the
        entry where a refit was sent since the rollout was), for a replica
        outside the group."""
        if self._fell_back:
            return self._fallback.catch_up(refits)
        out = dict(refits)
        for target, (_, ref) in refits.items():
            if ref is None:
                version = self.latest[target][0]
                cached = self._catch_up_refs.get(target)
                if cached is None or cached[0] != version:
                    cached = self._catch_up_refs[target] = (version, ray.put(self._weights[target]))
                out[target] = cached
        return out

    def _send(self, target: str, weights: dict[str, torch.Tensor], version: int):
        try:
            self._ensure_group()
        except WeightSyncError as e:
            if self._fallback is None:
                raise
            log.warning("rollout.weight_sync.transport=auto: %s; weights go through Ray's object "
                        "store from now on", e)
            self._fell_back = True
            return self._fallback.send(target, weights, version)._wait()
        if self._pg is None:  # no replica is up: the ones Serve starts catch up
            return [], 0.0, 0.0
        buckets = plan_buckets(weights, self.bucket_bytes)
        t0 = time.perf_counter()
        receiving = self._start("receive_weights", target, buckets, version, self._group_id)
        try:
            for bucket in buckets:
                self._pg.broadcast(pack_bucket(weights, bucket).to(self.device), 0).wait()
        except Exception as e:
            # A member died or failed mid-refit: the group is unusable; the
            # next refit forms a new one. A replica that died is replaced by
            # Serve (its replacement catches up); one that failed is behind.
            self._drop_group()
            outs = receiving.result()
            dead = [o for o in outs if isinstance(o, ray.exceptions.RayActorError)]
            if dead:
                raise dead[0] from e
            raise WeightSyncError(f"{target} refit to version {version} failed in the weight-sync group: "
                                  f"{e}; replicas: {outs}") from e
        sent = time.perf_counter()
        return _raise_first(receiving.result()), sent - t0, time.perf_counter() - sent

    def _start(self, method: str, *args) -> concurrent.futures.Future:
        """Broadcast ``method`` to the replicas now; the future gives their
        results, exceptions included. (Serve dispatches a broadcast when its
        results are first asked for, so a thread asks.)"""
        response = self._replicas.broadcast(method, *args)
        return self._waiters.submit(response.results, return_exceptions=True)

    def rollout_refits(self) -> dict[str, tuple[int, Any]]:
        return self._fallback.rollout_refits() if self._fell_back else super().rollout_refits()

    def take_stats(self) -> dict[str, Any]:
        stats = super().take_stats()
        if self._fell_back:
            stats["weight_sync_transport"] = self._fallback.name
        return stats

    def _ensure_group(self) -> None:
        """Form the group anew unless every live replica is in the current
        one (a replica Serve started since, or a new trainer rank 0 after a
        Train restart, makes a new group)."""
        members = self._replicas.broadcast("weight_sync_member").results()
        ids = frozenset(m["replica_id"] for m in members)
        if self._pg is not None and ids == self._members and \
                all(m["group_id"] == self._group_id for m in members):
            return
        self._drop_group()
        if not members:
            return
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group
        from vllm.utils.network_utils import get_open_port

        offsets, world = {}, 1
        for m in sorted(members, key=lambda m: m["replica_id"]):
            offsets[m["replica_id"]] = world
            world += m["num_workers"]
        host, port, group_id = ray.util.get_node_ip_address(), get_open_port(), uuid.uuid4().hex
        joining = self._start("join_weight_sync", host, port, offsets, world, self.backend, self.timeout_s,
                              group_id)
        try:
            pg = stateless_init_torch_distributed_process_group(
                host, port, 0, world, self.backend, timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:
            raise WeightSyncError(
                f"the weight-sync group at {host}:{port} ({self.backend}, {world} ranks: rank 0 and "
                f"replicas {offsets} at their first rank) did not form within {self.timeout_s:.0f} s "
                f"({type(e).__name__}: {e}); the replicas said: {joining.result()}") from e
        _raise_first(joining.result())
        self._pg, self._group_id, self._members = pg, group_id, ids
        log.info("weight sync: %s group of %d ranks formed at %s:%d (replicas %s)", self.backend, world,
                 host, port, sorted(offsets))

    def _drop_group(self) -> None:
        pg, self._pg, self._group_id = self._pg, None, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception as e:  # a member is gone; nothing to flush
                log.debug("weight-sync group shutdown: %s", e)

    def close(self) -> None:
        """Stop the sender (after the refits queued) and leave the group."""
        self._sender.shutdown(wait=True)
        self._waiters.shutdown(wait=False)
        self._drop_group()


class LocalReplicas:
    """Serve's ``handle.broadcast`` over ``SpecVLLMEngine``s in this process,
    each call in its own thread as replicas run concurrently: drives a
    transport without Serve (the GPU smoke, benchmarks, tests)."""

    def __init__(self, engines: list):
        self.engines = engines
        self._pool = concurrent.futures.ThreadPoolExecutor(max(2, 2 * len(engines)),
                                                           thread_name_prefix="rayspec-local-replica")

    def broadcast(self, method: str, *args):
        futures = [self._pool.submit(getattr(e, method), *args) for e in self.engines]

        class Response:
            def results(self, return_exceptions: bool = False) -> list:
                if return_exceptions:
                    return [f.exception() or f.result() for f in futures]
                return [f.result() for f in futures]

        return Response()


def _raise_first(results: list) -> list:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def make_transport(ws, replicas, trainer_has_gpu: bool, replicas_have_gpu: bool, shared_gpus: bool = False,
                   device: torch.device | str = "cpu"):
    """The transport ``ws`` (``WeightSyncConfig``) asks for.

    Args:
        replicas: the rollout deployment's handle.
        trainer_has_gpu / replicas_have_gpu: where the two ends compute
            (``backend: auto`` picks nccl only if both do).
        shared_gpus: replicas share the trainer's GPUs (colocated): NCCL
            refuses two ranks on one device, so ``auto`` picks gloo.
        device: rank 0's device (the nccl buckets' device).
    """
    object_store = ObjectStoreTransport(replicas)
    if ws.transport == "object_store":
        return object_store
    backend = ws.backend if ws.backend != "auto" else \
        "nccl" if trainer_has_gpu and replicas_have_gpu and not shared_gpus else "gloo"
    return CollectiveTransport(replicas, backend, ws.packed_buffer_size_bytes, ws.timeout_s,
                               device if backend == "nccl" else "cpu",
                               fallback=object_store if ws.transport == "auto" else None)
