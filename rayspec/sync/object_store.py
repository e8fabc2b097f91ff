"""The ``object_store`` transport: one ``ray.put`` of the host state dict, a
broadcast of its ObjectRef to every replica, and each replica reads it and
stages it as a safetensors file for vLLM's in-place reload (tensors passed as
``collective_rpc`` arguments would arrive serialized as lists). Simple, and
right for tiny models; at 16 GB it is three host copies and a TCP transfer
per replica. Replicas outside a collective group catch up through it too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch
from safetensors.torch import save_file

from rayspec.buckets import state_dict_nbytes
from rayspec.sync.interfaces import Refit, RefitHost, WeightReceiver, WeightSender, all_landed


class ObjectStoreSender(WeightSender):
    """Weights through Ray's object store (see the module docstring).

    Args:
        replicas: the rollout replicas (``RolloutClient``).
    """

    name = "object_store"

    def send(self, target: str, weights: dict[str, torch.Tensor], version: int) -> Refit:
        t0 = time.perf_counter()
        ref = ray.put(weights)
        self.latest[target] = (version, ref)
        response = self.replicas.receive_refit(target, ref, version)
        sent = time.perf_counter()

        def wait():
            out = all_landed(response)
            return out, sent - t0, time.perf_counter() - sent

        return Refit(self, wait, state_dict_nbytes(weights))

    def catch_up(self, refits: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
        return refits  # the ObjectRefs are already there


class ObjectStoreReceiver(WeightReceiver):
    """A replica's side: stages each refit as a safetensors file (in tmpfs
    where /dev/shm is writable) outside the engine's lock, beside a running
    rollout, then loads it through the worker extension under the lock."""

    def __init__(self, host: RefitHost):
        super().__init__(host)
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.staging_dir = Path(tempfile.mkdtemp(prefix="rayspec-refit-", dir=shm))

    def receive(self, target: str, weights, version: int) -> int:
        """Load ``target``'s weights ({name: host tensor}, or an ObjectRef
        of one) at ``version``; returns the version."""
        if isinstance(weights, ray.ObjectRef):
            weights = ray.get(weights)
        path = self._write(weights, target)
        try:
            return self.host.load_refit(target, version, lambda: self.host.llm.collective_rpc(
                "rayspec_load", args=(target, path)))
        finally:
            os.unlink(path)

    def _write(self, state_dict: dict[str, torch.Tensor], name: str) -> str:
        path = self.staging_dir / f"{name}.safetensors"
        # Tied weights (embed_tokens / lm_head) share storage; vLLM ties them
        # itself, so the first name of each storage is enough.
        seen, tensors = set(), {}
        for k, v in state_dict.items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                tensors[k] = v.contiguous()
        save_file(tensors, str(path))
        return str(path)

    def close(self) -> None:
        shutil.rmtree(self.staging_dir, ignore_errors=True)
