"""Weight sync: how a refit's weights travel from the Train ranks to every
vLLM worker (``rollout.weight_sync.transport``). The interfaces
(``interfaces.py``): a weight source on every Train rank, ``WeightSender``
on rank 0, ``WeightReceiver`` in each replica; one module per transport
holds its classes (``collective.py``, ``shared_memory.py``, ``ipc.py``).
``object_store.py`` carries what vLLM's weight-transfer interface has no
call for: a replica Serve restarted catching up (``WeightSender.catch_up``),
and the draft head under cuda_ipc (host tensors, no device export)."""

from __future__ import annotations

import torch

from rayspec.config import collective_backend, refit_from_trainer_memory
from rayspec.sync.collective import CollectiveReceiver, CollectiveSender, DeviceGather
from rayspec.sync.interfaces import HostGather, Refit, RefitHost, WeightReceiver, WeightSender, WeightSyncError
from rayspec.sync.ipc import CudaIpcReceiver, CudaIpcSender, DeviceExport, IpcWeights
from rayspec.sync.lora import AdapterGather, AdapterReceiver, AdapterSender
from rayspec.sync.object_store import ObjectStoreReceiver, ObjectStoreSender
from rayspec.sync.shared_memory import SharedMemoryReceiver, SharedMemorySender

__all__ = ["AdapterGather", "AdapterReceiver", "AdapterSender", "CollectiveReceiver", "CollectiveSender",
           "CudaIpcReceiver", "CudaIpcSender", "DeviceExport",
           "DeviceGather", "HostGather", "IpcWeights", "ObjectStoreReceiver", "ObjectStoreSender", "Refit", "RefitHost",
           "SharedMemoryReceiver", "SharedMemorySender", "WeightReceiver", "WeightSender", "WeightSyncError",
           "make_sender", "make_source"]


def make_sender(ws, replicas, trainer_has_gpu: bool, replicas_have_gpu: bool, shared_gpus: bool = False,
                device: torch.device | str = "cpu", lora: bool = False) -> WeightSender:
    """The sender ``ws`` (``WeightSyncConfig``) asks for.

    Args:
        replicas: the rollout replicas (``rayspec.rollout.RolloutClient``).
        trainer_has_gpu / replicas_have_gpu: where the two ends compute
            (``backend: auto`` picks nccl only if both do).
        shared_gpus: replicas share the trainer's GPUs (colocated): NCCL
            refuses two ranks on one device, so ``auto`` picks gloo.
        device: rank 0's device (the nccl buckets' device).
        lora: a LoRA policy (``train.lora``): its refits are the adapter
            (``AdapterSender``), the draft head's go through ``ws``'s transport.
    """
    if lora:
        return AdapterSender(replicas, make_sender(ws, replicas, trainer_has_gpu, replicas_have_gpu, shared_gpus,
                                                   device))
    if ws.transport == "cuda_ipc":
        return CudaIpcSender(replicas)
    if ws.transport == "shared_memory":
        return SharedMemorySender(replicas, ws.packed_buffer_size_bytes)
    backend = collective_backend(ws, trainer_has_gpu, replicas_have_gpu, shared_gpus)
    return CollectiveSender(replicas, backend, ws.packed_buffer_size_bytes, ws.timeout_s,
                            device if backend == "nccl" else "cpu")


def make_source(cfg, ranks, device: torch.device | str = "cpu", adapter_config: dict | None = None
                ) -> HostGather | DeviceExport | DeviceGather | AdapterGather:
    """Every Train rank's weight source for ``cfg``'s (a RunConfig) transport:
    ``AdapterGather`` for a LoRA policy (``adapter_config``: its
    ``adapter_config.json`` as a dict); ``DeviceExport`` (cuda_ipc: this
    rank's copy on ``device``, its device); ``DeviceGather`` (rank 0's
    weights where they are: ``rayspec.config.refit_from_trainer_memory``);
    else ``HostGather`` (rank 0's host copies)."""
    if cfg.train.lora.enabled:
        return AdapterGather(ranks, adapter_config)
    if cfg.rollout.weight_sync.transport == "cuda_ipc":
        return DeviceExport(ranks, torch.device(device))
    return DeviceGather(ranks) if refit_from_trainer_memory(cfg) else HostGather(ranks)
