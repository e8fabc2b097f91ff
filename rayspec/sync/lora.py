"""Adapter-only refits of a LoRA policy (``train.lora``): rank 0 sends the
adapter (A and B of every adapted layer, peft's names and config) through
Ray's object store, and each replica writes it in peft's format on its own
node and registers it as a new vLLM LoRA version (``AsyncLLM.add_lora``:
a new name, id and path per version; vLLM 0.32's ``LoRARequest`` takes a
directory only, and keys its prefix cache by the adapter's name, so a
version is never reloaded under an old name). Its requests then carry that
version's ``LoRARequest``. The base weights never move after the replicas
load them: a full-weight reload would clear every adapter (vLLM's
``reload_weights`` -> ``reset_lora_state``). The draft head's refits go
through the run's transport as without LoRA (they leave the adapters
loaded).

An adapter is small (r = 16 on every linear layer of SmolLM2-135M: 4.9 M
parameters, 9.8 MB in bf16 against 271 MB for the full policy), so one
``ray.put`` shared by every replica is the transport; TRL's AsyncGRPO and verl send adapters the same
way (as tensors, not through a collective group).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

import ray
import torch

from rayspec.buckets import state_dict_nbytes
from rayspec.sync.interfaces import Refit, RefitHost, WeightReceiver, WeightSender, all_landed, host_copies

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def write_adapter(tensors: dict[str, torch.Tensor], config: dict[str, Any], out: str | Path) -> Path:
    """Write an adapter in peft's format into the directory ``out`` (created):
    ``adapter_model.safetensors`` (``tensors``: host tensors, peft's
    ``base_model.model.<module>.lora_A.weight`` names) and
    ``adapter_config.json`` (``config``: peft's ``LoraConfig`` as a dict),
    what vLLM's ``LoRARequest`` and peft's ``PeftModel.from_pretrained``
    read. Returns ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / ADAPTER_FILES[0]))
    (out / ADAPTER_FILES[1]).write_text(json.dumps(config, indent=1))
    return out


class AdapterGather:
    """The weight source of a LoRA policy on every Train rank: rank 0's
    adapter as host copies with its config, ``{"tensors": {name: tensor},
    "config": dict}`` (None on the other ranks), owned by the sender from
    then on. ZeRO 0-2 hold the adapter whole on every rank: nothing is
    collective.

    Args:
        ranks: this rank among the Train workers.
        config: the adapter's ``adapter_config.json`` as a dict
            (``rayspec.train.lora.adapter_config``).

    Attributes:
        reads_device: False (``HostGather``'s).
    """

    reads_device = False

    def __init__(self, ranks, config: dict[str, Any]):
        self.ranks, self.config = ranks, config

    def collect(self, weights: Iterable[tuple[str, torch.Tensor, bool]], dtype: torch.dtype) -> dict | None:
        """``weights`` (the adapter's (name, tensor, persistent):
        ``rayspec.train.lora.adapter_parameters``) in ``dtype`` on rank 0
        with the config; None elsewhere."""
        tensors = host_copies(weights, dtype, self.ranks.is_driver)
        return {"tensors": tensors, "config": self.config} if tensors is not None else None

    def done(self) -> None:
        """Nothing to drop: the sender owns the host copies."""


class AdapterSender(WeightSender):
    """The trainer's side (see the module docstring): a policy refit is the
    adapter (``AdapterGather``'s payload) in one ``ray.put``, broadcast to
    every replica's ``receive_refit``; a draft refit goes to ``inner``, the
    run's transport (``rayspec.sync.make_sender``).

    Args:
        replicas: the rollout replicas (``RolloutClient``).
        inner: the sender of the draft head's refits.
    """

    def __init__(self, replicas, inner: WeightSender):
        super().__init__(replicas)
        self.inner = inner
        self.name = f"lora_adapter+{inner.name}"

    def send(self, target: str, weights, version: int) -> Refit:
        if target != "policy":
            return self.inner.send(target, weights, version)
        t0 = time.perf_counter()
        ref = ray.put(weights)
        self.latest["policy"] = (version, ref)
        response = self.replicas.receive_refit("policy", ref, version)
        sent = time.perf_counter()

        def wait():
            out = all_landed(response)
            return out, sent - t0, time.perf_counter() - sent

        return Refit(self, wait, state_dict_nbytes(weights["tensors"]))

    def rollout_refits(self) -> dict[str, tuple[int, Any]]:
        return {**self.inner.rollout_refits(), **self.latest}

    def catch_up(self, refits: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
        # the adapter's ObjectRef is already there; the head's is the inner transport's
        rest = {t: r for t, r in refits.items() if t != "policy"}
        return {**refits, **self.inner.catch_up(rest)}

    def take_stats(self) -> dict[str, Any]:
        mine, inner = super().take_stats(), self.inner.take_stats()
        return {**mine, **{k: mine[k] + inner[k] for k in mine if k != "weight_sync_transport"}}

    def close(self) -> None:
        self.inner.close()


class AdapterReceiver(WeightReceiver):
    """A replica's side: writes each adapter version in peft's format under
    its own staging directory (outside the engine's lock, beside a running
    rollout), then registers it through the host's ``load_refit``
    (``SpecVLLMEngine.add_adapter``: ``add_lora``, and the versions no
    request uses any more removed with their files).

    Args:
        host: the replica's engine; ``add_adapter(version, path)`` loads one.
        staging_dir: where each version's directory is written
            (``policy-v<version>``).
    """

    def __init__(self, host: RefitHost, staging_dir: str | Path):
        super().__init__(host)
        self.staging_dir = Path(staging_dir)

    def receive(self, payload, version: int) -> int:
        """Register the adapter ``payload`` (``AdapterGather``'s, or an
        ObjectRef of it) as policy ``version``; returns the version."""
        if isinstance(payload, ray.ObjectRef):
            payload = ray.get(payload)
        path = write_adapter(payload["tensors"], payload["config"], self.staging_dir / f"policy-v{version}")
        try:
            return self.host.load_refit("policy", version, lambda: self.host.add_adapter(version, str(path)),
                                        adapter=True)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise

