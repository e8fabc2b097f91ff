"""Weight sync as small interfaces: ``WeightSender`` on the trainer's rank 0,
``WeightReceiver`` in each rollout replica, one class of each per transport
(``object_store.py``, ``collective.py``, ``shared_memory.py``, ``ipc.py``),
and a weight source on every Train rank that collects what the sender sends
(``HostGather``, ``collective.DeviceGather`` or ``ipc.DeviceExport``). The RL step only calls these: it
never branches on the transport (as NeMo-RL's ``weight_sync`` interfaces).

A refit's ``target`` is ``policy`` (the verifier's HF-named weights) or
``draft`` (the EAGLE-3 head's vLLM-named weights); its ``version`` counts
optimizer steps (policy) or draft-trainer versions (draft).
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterable, Iterator, Protocol

import ray
import torch

TARGETS = ("policy", "draft")


class WeightSyncError(RuntimeError):
    """The weight-sync group could not form, or a refit through it failed."""


def all_landed(response) -> list:
    """Every replica's result of a refit broadcast (``RolloutClient``'s
    ``receive_*``), once all have answered: a replica that dies does not cut
    the wait short while the others still read what the sender frees after
    it (a shared-memory refit's files: a survivor once lost them mid-load
    and kept a half-reloaded model).

    Raises:
        What a live replica raised, before a dead replica's
        ``RayActorError`` (which the rollout pipeline skips: Serve's
        replacement catches up).
    """
    results = response.results(return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise min(errors, key=lambda e: isinstance(e, ray.exceptions.RayActorError))
    return results


def transfer_round(engine, target: str, update_info: dict[str, Any]) -> None:
    """One refit of ``target`` through vLLM's weight-transfer round on a
    replica's engine (``rayspec.vllm.engines``):
    ``start_weight_update`` (``start_draft_weight_update`` for the draft
    head), ``update_weights`` with the worker-side engine's ``update_info``,
    ``finish_weight_update``.

    Raises:
        Whatever the workers' engine raised (vLLM ends the round then).
    """
    engine.start_weight_update(draft=target == "draft")
    engine.update_weights(update_info)
    engine.finish_weight_update()


class Refit:
    """A refit on its way to every replica. ``results()`` waits until it has
    landed (the rollout pipeline's refit tracking calls it) and returns the
    replicas' results; what it moved and how long it took go to the sender's
    ``take_stats``.

    Args:
        sender: the WeightSender that sent it.
        wait: returns (replica results, transfer seconds, load seconds), or
            raises what a replica raised.
        nbytes: bytes the refit moves.
    """

    def __init__(self, sender: "WeightSender", wait: Callable[[], tuple[list, float, float]], nbytes: int):
        self._sender, self._wait, self.nbytes = sender, wait, nbytes
        self._results: list | None = None

    def results(self) -> list:
        if self._results is None:
            self._results, transfer_s, load_s = self._wait()
            self._sender.landed(self.nbytes, transfer_s, load_s)
        return self._results


class WeightSender(abc.ABC):
    """The trainer's side of a transport: sends each refit to every replica,
    keeps the newest weights of each target for replicas that fall behind,
    and accounts for what landed.

    Args:
        replicas: the rollout replicas (``rayspec.rollout.RolloutClient``).

    Attributes:
        name: the transport's name (``rollout.weight_sync.transport``).
        latest: {target: (version, ObjectRef or None)}: the newest refit of
            each target, as the next rollout carries it (``rollout_refits``).
    """

    name = ""

    def __init__(self, replicas):
        self.replicas = replicas
        self.latest: dict[str, tuple[int, Any]] = {}
        self._landed: list[tuple[int, float, float]] = []
        self._weights: dict[str, dict[str, torch.Tensor]] = {}  # the newest of each target (``_put_newest``)
        self._catch_up_refs: dict[str, tuple[int, Any]] = {}

    @abc.abstractmethod
    def send(self, target: str, weights: dict[str, torch.Tensor], version: int) -> Refit:
        """Start sending ``weights`` (host tensors) of ``target`` at
        ``version`` to every replica; returns at once."""

    @abc.abstractmethod
    def catch_up(self, refits: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
        """``refits`` with every payload a replica outside this transport
        cannot receive (None) replaced by the newest weights as ObjectRefs."""

    def _put_newest(self, refits: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
        """``catch_up`` for a transport that leaves ``latest``'s payloads
        None: each replaced by the newest weights of its target (kept in
        ``_weights`` by ``send``) as an ObjectRef of host copies (they may be
        rank 0's device tensors: ``collective.DeviceGather``), put once per
        version."""
        import ray

        from rayspec.devices import to_host

        out = dict(refits)
        for target, (_, ref) in refits.items():
            if ref is None:
                version = self.latest[target][0]
                cached = self._catch_up_refs.get(target)
                if cached is None or cached[0] != version:
                    cached = self._catch_up_refs[target] = (version, ray.put(to_host(self._weights[target])))
                out[target] = cached
        return out

    def rollout_refits(self) -> dict[str, tuple[int, Any]]:
        """``refits`` for the next rollout: {target: (version, ObjectRef or
        None)}; a replica behind a None entry raises ``ReplicaBehind``."""
        return dict(self.latest)

    def landed(self, nbytes: int, transfer_s: float, load_s: float) -> None:
        """Account for a refit that landed (``Refit.results`` calls it)."""
        self._landed.append((nbytes, transfer_s, load_s))

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
        """Stop sending (after the refits queued) and release what the transport holds."""


def resident(state_dict: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """A state dict whose tensors outlive the refit (ZeRO 0-2's parameters,
    host copies) as weight sources take weights: (name, tensor, persistent
    True)."""
    return ((name, t, True) for name, t in state_dict.items())


def copy_weights(weights: Iterable[tuple[str, torch.Tensor, bool]],
                 copy: Callable[[torch.Tensor, bool], torch.Tensor],
                 keep: bool = True) -> dict[str, torch.Tensor] | None:
    """{name: copy(tensor, persistent)} of ``weights`` ((name, tensor,
    persistent), e.g. ``rayspec.train.policy.full_parameters``, iterated to
    the end: a collective under ZeRO-3); persistent tensors that are one
    (tied embeddings) are copied once and stay one. None where not
    ``keep`` (nothing copied)."""
    out, copies = {}, {}
    for name, t, persistent in weights:
        if not keep:
            continue
        if persistent and t.data_ptr() and t.data_ptr() in copies:
            out[name] = copies[t.data_ptr()]
            continue
        out[name] = copy(t, persistent)
        if persistent:
            copies[t.data_ptr()] = out[name]
    return out if keep else None


def host_copies(weights: Iterable[tuple[str, torch.Tensor, bool]], dtype: torch.dtype | None,
                keep: bool = True) -> dict[str, torch.Tensor] | None:
    """Host copies of ``weights`` (``copy_weights``) in ``dtype`` (floating
    point only; None: each tensor's own); None where not ``keep``."""
    from rayspec.devices import to_host

    return copy_weights(weights, lambda t, _: to_host({"w": t}, dtype)["w"], keep)


class HostGather:
    """What the object store and shared memory send, and the collective
    under ZeRO-3 or colocated on GPUs: the full policy as host copies on
    rank 0 (``host_copies``; None on the other ranks), owned by the sender
    from then on. ``DeviceGather`` (``collective.py``) and ``DeviceExport``
    (``ipc.py``) are the other weight sources, with the same methods.

    Args:
        ranks: this rank among the Train workers (``rayspec.train.ranks.Ranks``).

    Attributes:
        reads_device: False: a colocated rank gives its device back before
            the replicas wake for the refit.
    """

    reads_device = False

    def __init__(self, ranks):
        self.ranks = ranks

    def collect(self, weights: Iterable[tuple[str, torch.Tensor, bool]],
                dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """``weights`` (this rank's full policy, (name, tensor, persistent)
        on any device; iterated on every rank) as host copies in ``dtype``
        on rank 0; None elsewhere."""
        return host_copies(weights, dtype, self.ranks.is_driver)

    def done(self) -> None:
        """Nothing to drop: the sender owns the host copies."""


class RefitHost(Protocol):
    """What a rollout replica (``rayspec.rollout.SpecVLLMEngine``) gives its
    receivers."""

    replica_id: str
    llm: Any

    def load_refit(self, target: str, version: int, load: Callable[[], None]) -> int:
        """Run ``load`` (which puts ``target``'s weights into the vLLM
        workers) under the engine's lock with its weights awake, then note
        ``version``; returns it."""


class WeightReceiver(abc.ABC):
    """A replica's side of a transport: puts the weights it receives into
    the vLLM workers through the host's ``load_refit``. Receivers reach the
    worker extension's methods (``rayspec.vllm.worker_ext``) by
    name through ``collective_rpc``: the worker side imports ``rayspec.sync``
    (the bucket layout, the CUDA IPC handles), not the reverse.

    Args:
        host: the replica's engine.
    """

    def __init__(self, host: RefitHost):
        self.host = host
