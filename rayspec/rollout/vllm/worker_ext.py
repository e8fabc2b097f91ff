"""vLLM worker extension: in-place refit of the policy and the draft head.

Loaded by ``vllm.LLM(worker_extension_cls=WORKER_EXTENSION)`` and reached
with ``llm.collective_rpc`` (the receiving side of ``rayspec.sync``'s
transports calls it by the methods' own names). Weights arrive either as a
safetensors file (e.g. under /dev/shm; the object-store transport: tensors
passed as collective_rpc arguments arrive serialized as lists) or as packed
buckets broadcast by the trainer in the weight-sync process group (the
collective transport, ``rayspec.sync``), streamed into the loader. Loading goes through
vLLM's in-place ``reload_weights``, which undoes the CPU backend's weight
repacking before ``load_weights`` and redoes it after; calling the model's
``load_weights`` directly fails once weights are repacked.

Both of vLLM 0.32's model runners are served: the V1 ``GPUModelRunner``
(CPU, and CUDA with ``VLLM_USE_V2_MODEL_RUNNER=0``) holds its drafter in
``drafter``, the V2 runner (CUDA's default for EAGLE-3 and draft models) in
``speculator``; both expose the draft model through ``get_draft_model()``,
unwrapped from any CUDA-graph wrapper, which is what is reloaded here.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from safetensors import safe_open

from rayspec.rollout.vllm import engine_access
from rayspec.rollout.vllm import touchpoints as tp
from rayspec.sync.buckets import bucket_nbytes, unpack_bucket

WORKER_EXTENSION = "rayspec.rollout.vllm.worker_ext.RefitExtension"


def _iter_file(path: str):
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _skipping(weights, skip: tuple[str, ...]):
    for name, t in weights:
        if not any(f"{s}." in name for s in skip):
            yield name, t


def _retie_embeddings(model) -> None:
    """Re-tie lm_head to embed_tokens. vLLM ties them by sharing one Parameter;
    the in-place reload replaces embed_tokens' Parameter and puts the old
    one back into lm_head (it gets no weights of its own), so without this
    a refit policy would keep its old output layer. On CPU the lm_head's
    GEMM holds a packed copy of the weight, rebuilt by
    ``process_weights_after_loading``."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and hasattr(model, "lm_head"):
        tp.require(model.lm_head, "tie_weights", tp.REFIT)(embed)
        quant = tp.require(model.lm_head, "quant_method", tp.REFIT)
        tp.require(quant, "process_weights_after_loading", tp.REFIT)(model.lm_head)


@contextlib.contextmanager
def _without_shared_modules(drafter_model, verifier):
    """Detach from the drafter the modules it shares with the verifier for
    the duration of a draft reload; yields their attribute names (the draft
    checkpoint's weights for them are skipped: the policy refit owns them).

    vLLM gives an EAGLE head the verifier's ``embed_tokens`` when the
    checkpoint has none, and the verifier's ``lm_head`` when the head's equals
    it at engine start (``init_head`` copies it). Reloading the whole drafter
    then wrote the head's ``lm_head`` (the initial policy's) into the
    verifier's output layer, which is tied to its embedding: each draft refit
    silently reverted the verifier's embedding and output layer to the
    initial policy, so rollouts no longer followed the policy being trained
    (SmolLM2, fp32: mean |p_vllm/p_policy - 1| of the sampled tokens 6e-6
    before, 3e-2 after one draft refit).
    """
    shared = {id(m) for m in verifier.modules()}
    swapped = []
    for name, module in list(drafter_model.named_modules()):
        if name and id(module) in shared:
            parent_name, _, child = name.rpartition(".")
            parent = drafter_model.get_submodule(parent_name)
            if getattr(parent, child, None) is module:  # not already under a detached parent
                swapped.append((parent, child, module))
                setattr(parent, child, nn.Module())
    try:
        yield tuple(child for _, child, _ in swapped)
    finally:
        for parent, child, module in swapped:
            setattr(parent, child, module)


class RefitExtension:
    """Mixed into vLLM's worker; ``self`` is the worker."""

    def _reload(self, model, weights, skip: tuple[str, ...] = ()) -> None:
        reload_weights = tp.RELOAD_WEIGHTS.load()
        weights = iter(weights)
        with tp.SET_CURRENT_CONFIG.load()(self.vllm_config):
            reload_weights(self.vllm_config, model, weights_iterator=_skipping(weights, skip),
                           weights_path=None, is_checkpoint_format=True)
        for _ in weights:  # the rest of a broadcast, had the loader stopped early
            pass
        # The EAGLE drafter shares the verifier's embed_tokens module, so
        # either reload can untie the verifier's output layer.
        _retie_embeddings(self.model_runner.get_model())

    def rayspec_seed(self, seed: int) -> None:
        """Reseed the worker's random streams: torch's generators, which the
        V1 runner's sampler, rejection sampler and drafters draw from for
        requests without their own seed, and NumPy's, which the V2 runner
        draws those requests' seeds from."""
        import numpy as np
        import torch

        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)

    def rayspec_model_runner(self) -> str:
        """The worker's model runner class (``module.Class``)."""
        runner = type(self.model_runner)
        return f"{runner.__module__}.{runner.__qualname__}"

    def rayspec_weight_sums(self, which: str = "policy") -> dict[str, float]:
        """{parameter name: sum of its values} of the verifier (``policy``)
        or the draft model (``draft``), under vLLM's module names: a cheap
        digest to check what a refit landed (the tensors themselves would
        travel to the caller serialized as lists). A linear layer whose
        weight rayspec's drafter patch packed in another dtype reports the
        packed copy's sum (vLLM's CPU path keeps no unpacked weight)."""
        runner = self.model_runner
        model = runner.get_model() if which == "policy" else \
            tp.require(runner, "get_draft_model", tp.REFIT)()
        if model is None:  # a drafter without a model (n-gram, suffix)
            return {}
        # accumulated in fp32 without an fp32 copy of the tensor (an 8B policy's embedding: 2.5 GB)
        sums = {name: float(p.detach().sum(dtype=torch.float32)) for name, p in model.named_parameters()}
        sums.update({f"{name}.weight": m.rayspec_weight_sum for name, m in model.named_modules()
                     if hasattr(m, "rayspec_weight_sum")})
        return sums

    def rayspec_draft_linear_dtypes(self) -> dict[str, str]:
        """{module name: dtype} of the drafter's own linear layers on the CPU
        platform (not those it shares with the verifier, e.g. embed_tokens):
        what each one computes in (``rayspec_linear_dtype`` where rayspec's
        patch packed it, ``additional_config.rayspec_draft_linear_dtype``;
        else its weight's dtype). Empty without a model-based drafter.

        Raises:
            VllmInternalsError: the model runner has no ``get_draft_model``.
        """
        model = tp.require(self.model_runner, "get_draft_model", tp.DRAFT_DTYPE)()
        if model is None:
            return {}
        shared = {id(m) for m in self.model_runner.get_model().modules()}
        return {name: str(getattr(m, "rayspec_linear_dtype", None) or m.weight.dtype)
                for name, m in model.named_modules() if hasattr(m, "cpu_linear") and id(m) not in shared}

    def rayspec_load(self, target: str, path: str) -> None:
        """Load ``target``'s weights from a safetensors file: ``policy``
        (HF names) into the verifier, ``draft`` (EAGLE-3 head, vLLM
        checkpoint names) into the drafter.

        Raises:
            RuntimeError: a draft refit where the engine has no model-based drafter.
            VllmInternalsError: the model runner has no ``get_draft_model``.
        """
        self._load(target, _iter_file(path))

    def _load(self, target: str, weights) -> None:
        if target == "policy":
            return self._reload(self.model_runner.get_model(), weights)
        draft_model = tp.require(self.model_runner, "get_draft_model", tp.REFIT)()
        if draft_model is None:
            raise RuntimeError("this engine has no model-based drafter to update")
        with _without_shared_modules(draft_model, self.model_runner.get_model()) as shared:
            self._reload(draft_model, weights, skip=shared)

    def rayspec_load_shared(self, target: str, files: list) -> None:
        """Load a refit of ``target`` from files in /dev/shm, [(path,
        bucket)] in the packed layout (the shared_memory transport,
        ``rayspec.sync.shared_memory``): each mapped read-only and its views
        streamed into the loader, no copy before vLLM's own."""
        def weights():
            for path, bucket in files:
                buffer = torch.from_file(path, shared=False, size=bucket_nbytes(bucket), dtype=torch.uint8)
                yield from unpack_bucket(buffer, bucket)

        self._load(target, weights())

    def rayspec_load_ipc(self, target: str, payload: dict, replica: str = "") -> None:
        """Load a refit of ``target`` from the Train ranks' exports (the
        cuda_ipc transport, ``rayspec.sync.ipc``): the handles of this
        worker's device, opened and streamed into the loader (on a GPU a
        copy within the device). Raises WeightSyncError where no rank
        exported on this worker's device."""
        from rayspec.sync.ipc import opened

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")  # vLLM's GPU worker sets its device current
        self._load(target, opened(payload, device, replica))

    def rayspec_join_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int,
                                 backend: str, timeout_s: float) -> int:
        """Join the trainer's weight-sync process group (vLLM's stateless
        group: no global ``init_process_group``), leaving any earlier one.
        This worker's rank is ``rank_offset`` + its rank in the replica
        (tensor / pipeline parallel). Returns that rank."""
        self.rayspec_leave_weight_sync()
        rank = rank_offset + self.vllm_config.parallel_config.rank
        self._rayspec_sync = (engine_access.stateless_group(host, port, rank, world_size, backend, timeout_s), backend)
        return rank

    def rayspec_leave_weight_sync(self) -> None:
        pg, _ = getattr(self, "_rayspec_sync", (None, None))
        self._rayspec_sync = (None, None)
        if pg is not None:
            with contextlib.suppress(Exception):  # the trainer that formed it may be gone
                pg.shutdown()

    def rayspec_receive_weights(self, target: str, buckets: list) -> None:
        """Receive a refit of ``target`` (``policy`` | ``draft``) broadcast
        from rank 0 in packed buckets (``rayspec.sync.buckets``),
        loading each bucket as it lands: one fresh buffer per bucket (the
        in-place reload may hold views until a layer is complete), on this
        worker's device for nccl, in host memory for gloo.

        Raises:
            RuntimeError: this worker is in no weight-sync group.
        """
        pg, backend = getattr(self, "_rayspec_sync", (None, None))
        if pg is None:
            raise RuntimeError("this worker has not joined a weight-sync group")
        device = self.device if backend == "nccl" else torch.device("cpu")

        def weights():
            for bucket in buckets:
                buffer = torch.empty(bucket_nbytes(bucket), dtype=torch.uint8, device=device)
                pg.broadcast(buffer, 0).wait()
                yield from unpack_bucket(buffer, bucket)

        self._load(target, weights())
