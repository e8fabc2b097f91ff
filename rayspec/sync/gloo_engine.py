"""vLLM weight-transfer engines over gloo, registered with vLLM 0.32's
``WeightTransferEngineFactory`` and ``WeightTransferTrainerFactory`` as
``gloo``: the CPU twin of vLLM's ``nccl`` engines, so CPU replicas and CI
run the control plane GPUs run (``init_weight_transfer_engine``,
``start_weight_update`` / ``start_draft_weight_update``, ``update_weights``,
``finish_weight_update``, weight versions); only the wire differs.

Why an engine of rayspec's: vLLM 0.32's dense engines are NCCL (PyNccl
communicators, CUDA streams in the packed loop) and CUDA IPC; none runs on a
CPU, and its base ``update_weights`` synchronizes an accelerator, which a
CPU has none of (``torch.accelerator.synchronize`` raises there).

The wire: trainer rank 0 and every vLLM worker of every replica form vLLM's
stateless gloo group (``rank_offset`` + the worker's rank in its replica);
a refit is one ``update_weights`` call whose info lists packed buckets
(``rayspec.buckets``), broadcast from rank 0 and streamed into vLLM's
in-place reload as they land (``worker_ext.load_weights``, which also keeps
the draft off the modules it shares with the verifier and re-ties a tied
output layer). ``start_weight_update`` and ``finish_weight_update`` load
nothing, so a refit never leaves the model half-loaded between calls.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                   VLLMWeightSyncClient, WeightSource, WeightTransferEngine,
                                                   WeightTransferInitInfo, WeightTransferUpdateInfo)

from rayspec.buckets import Bucket, bucket_nbytes, pack_bucket, plan_buckets, unpack_bucket
from rayspec.vllm import engine_access

BACKEND = "gloo"
DEFAULT_TIMEOUT_S = 600.0


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """A worker's side of the group (``init_weight_transfer_engine``'s
    ``init_info``): rank 0's address and port, this replica's first rank,
    the group's size (trainer rank 0 plus every worker), the rendezvous
    timeout (seconds)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One refit (``update_weights``'s ``update_info``): its packed buckets,
    [[(name, torch dtype name, shape), ...], ...] in broadcast order."""

    buckets: list[Bucket]


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """The worker's side (in each vLLM worker process; the worker retargets
    it at the drafter for ``start_draft_weight_update``)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join rank 0's group (leaving any earlier one); blocks until every
        rank has joined, at most ``timeout_s``."""
        self.shutdown()
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = engine_access.stateless_group(init_info.master_address, init_info.master_port, rank,
                                                   init_info.world_size, BACKEND, init_info.timeout_s)

    def start_weight_update(self) -> None:
        """Nothing to prepare: ``update_weights`` reloads in one call."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one refit; no accelerator sync (the buckets land
        in host memory and the loader copies them synchronously)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive each bucket of the broadcast into a fresh host buffer (the
        in-place reload may hold views until a layer is complete) and stream
        it into the target model.

        Raises:
            RuntimeError: no ``init_weight_transfer_engine`` before.
        """
        from rayspec.vllm.worker_ext import load_weights

        if self.group is None:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        group = self.group

        def weights():
            for bucket in update_info.buckets:
                buffer = torch.empty(bucket_nbytes(bucket), dtype=torch.uint8)
                group.broadcast(buffer, 0).wait()
                yield from unpack_bucket(buffer, bucket)

        verifier = self._default_model
        load_weights(self.vllm_config, verifier, None if self.model is verifier else self.model, weights())

    def finish_weight_update(self) -> None:
        """Nothing left to finalize: ``update_weights`` loaded the refit whole."""

    def shutdown(self) -> None:
        self.group = _leave(self.group)


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the group: the address and port rank 0's store
    listens on (``listen_socket``: a socket already bound there, which the
    store takes over), the group's size, the bucket size (bytes) and the
    rendezvous timeout (seconds)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    packed_buffer_size_bytes: int = 1 << 30
    timeout_s: float = DEFAULT_TIMEOUT_S
    listen_socket: Any = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's side: rank 0 holds the group and drives each refit's
    round trip through ``client`` (``VLLMWeightSyncClient``)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True,
                 packed_buffer_size_bytes: int = 1 << 30):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.group = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> "GlooTrainerWeightTransferEngine":
        """Form the group with the workers (their ``init_weight_transfer_engine``
        runs beside rank 0's rendezvous; workers from rank 1).

        Raises:
            ValueError: no ``source``.
            Whatever the rendezvous or a worker raised.
        """
        if source is None:
            raise ValueError("gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     packed_buffer_size_bytes=init_info.packed_buffer_size_bytes)
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(init_info.master_address, init_info.master_port, 1,
                                                 init_info.world_size, init_info.timeout_s)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            joining = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = engine_access.stateless_group(
                init_info.master_address, init_info.master_port, 0, init_info.world_size, BACKEND,
                init_info.timeout_s, listen_socket=init_info.listen_socket)
            joining.result()
        return engine

    def send_weights(self) -> None:
        """One refit of the source's weights (host tensors): start, then
        ``update_weights`` on the workers beside the broadcast of every
        bucket, then finish. Non-sender ranks only iterate the source.

        Raises:
            Whatever a worker or the broadcast raised (the group is then
            unusable: ``shutdown`` and form another).
        """
        weights = dict(iter(self.source))
        if not self.is_sender:
            return
        buckets = plan_buckets(weights, self.packed_buffer_size_bytes)
        self.client.start_weight_update()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            receiving = pool.submit(self.client.update_weights, asdict(GlooWeightTransferUpdateInfo(buckets)))
            for bucket in buckets:
                self.group.broadcast(pack_bucket(weights, bucket), 0).wait()
            receiving.result()
        finally:
            pool.shutdown(wait=False)  # a worker stuck in a broken broadcast must not hang the caller
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = _leave(self.group)


def _leave(group) -> None:
    """Shut ``group`` down (None: nothing to do); a member already gone
    leaves nothing to flush. Returns None, the group's new value."""
    if group is not None:
        try:
            group.shutdown()
        except Exception:  # the other side may be gone
            pass
    return None


def register() -> None:
    """vLLM general-plugin hook: register both sides as ``gloo`` (idempotent;
    every vLLM process loads the plugins)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, GlooWeightTransferEngine),
                         (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine)):
        try:
            factory.register_engine(BACKEND, cls)
        except ValueError:  # registered already (vLLM's message: "... is already registered")
            pass
