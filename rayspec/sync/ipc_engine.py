"""The CPU twin of vLLM 0.32's ``ipc`` weight-transfer engine, registered
with its ``WeightTransferEngineFactory`` as ``cpu_ipc``: the cuda_ipc
transport's worker side on CPUs (``rayspec.sync.ipc``), so CI runs the round
GPUs run with vLLM's own engine (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights`` with an
``IPCWeightTransferUpdateInfo``, ``finish_weight_update``); only the handles
differ.

Why an engine of rayspec's: vLLM's ``IPCWeightTransferEngine`` rebuilds CUDA
tensors from CUDA IPC handles (``rebuild_cuda_tensor``), and its base
``update_weights`` synchronizes an accelerator, which a CPU has none of. The
twin opens the export of its host instead (a file in /dev/shm,
``ipc.open_shared``) and loads it through rayspec's in-place reload
(``worker_ext.load_weights``, as the gloo engine does: vLLM's layer-by-layer
reload leaves the CPU backend's packed copy of a tied output layer stale).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo

from rayspec.sync.interfaces import WeightSyncError
from rayspec.sync.ipc import device_key, open_shared

BACKEND = "cpu_ipc"


class CpuIpcWeightTransferEngine(IPCWeightTransferEngine):
    """The worker's side (in each vLLM worker process; the worker retargets
    it at the drafter for ``start_draft_weight_update``). Unpacked handles
    only (``init_weight_transfer_engine({"packed": False})``)."""

    def start_weight_update(self) -> None:
        """Nothing to prepare: ``update_weights`` reloads in one call."""

    def finish_weight_update(self) -> None:
        """Nothing left to finalize: ``update_weights`` loaded the refit whole."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Open and load one refit; no accelerator sync."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        """Open each tensor's export on this host (``ipc.open_shared``: a
        mapping, no copy) and stream it into the target model.

        Raises:
            ValueError: a packed transfer (the twin opens per-tensor handles).
            WeightSyncError: no Train rank exported on this host (names it
                and the hosts that did).
        """
        from rayspec.vllm.worker_ext import load_weights

        if self.packed or not isinstance(update_info.ipc_handles, list):
            raise ValueError(f"{BACKEND}: packed transfers are not supported (init with packed=False)")
        key = device_key(torch.device("cpu"))
        missing = [handles for handles in update_info.ipc_handles if key not in handles]
        if missing:  # refused before the reload starts: the model keeps its weights whole
            raise WeightSyncError(f"no Train rank exported the policy on {key} (exports on {sorted(missing[0])}): "
                                  "rollout.weight_sync.transport=cuda_ipc needs every replica on a Train rank's "
                                  "host (scheduler.layout=colocate)")
        weights = ((name, open_shared(handles[key])) for name, handles in zip(update_info.names,
                                                                              update_info.ipc_handles))
        verifier = self._default_model
        load_weights(self.vllm_config, verifier, None if self.model is verifier else self.model, weights)


def register() -> None:
    """vLLM general-plugin hook: register the worker side as ``cpu_ipc``
    (idempotent; every vLLM process loads the plugins)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, CpuIpcWeightTransferEngine)
    except ValueError:  # registered already (vLLM's message: "... is already registered")
        pass
