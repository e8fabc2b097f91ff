"""vLLM worker extension: in-place refit of the policy and the draft head
by the transports vLLM's weight-transfer engines do not cover.

Loaded by the replica's engine (``worker_extension_cls=WORKER_EXTENSION``) and
reached with its ``collective_rpc`` (the receiving side of ``rayspec.sync``'s
transports calls it by the methods' own names). Weights arrive as a
safetensors file (e.g. under /dev/shm; the object-store transport: tensors
passed as collective_rpc arguments arrive serialized as lists) or as packed
files in /dev/shm (shared memory). The collective and cuda_ipc transports go
through vLLM's weight-transfer engines instead (``rayspec.sync.collective``,
``rayspec.sync.ipc``); rayspec's CPU engines (``gloo``, ``cpu_ipc``) load
with ``load_weights`` below. Loading goes through vLLM's in-place
``reload_weights``, which undoes the CPU backend's weight repacking before
``load_weights`` and redoes it after; calling the model's ``load_weights``
directly fails once weights are repacked.

Both of vLLM 0.32's model runners are served: the V1 ``GPUModelRunner``
(CPU, and CUDA with ``VLLM_USE_V2_MODEL_RUNNER=0``) holds its drafter in
``drafter``, the V2 runner (CUDA's default for EAGLE-3 and draft models) in
``speculator``; both expose the draft model through ``get_draft_model()``,
unwrapped from any CUDA-graph wrapper, which is what is reloaded here.

Also: the suffix drafter's cache takes text of rayspec's to draft from
(``rayspec_index_suffix_text``: a trajectory's tool outputs, for its siblings).
"""

from __future__ import annotations

import contextlib
import uuid

import torch
import torch.nn as nn
from safetensors import safe_open

from rayspec.buckets import bucket_nbytes, unpack_bucket
from rayspec.vllm import touchpoints as tp

WORKER_EXTENSION = "rayspec.vllm.worker_ext.RefitExtension"


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


def _shared_modules(drafter_model, verifier) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, module) of each outermost module of the
    drafter that is one of the verifier's."""
    shared = {id(m) for m in verifier.modules()}
    out, inside = [], set()
    for name, module in drafter_model.named_modules():
        if name and id(module) in shared and not any(name.startswith(f"{p}.") for p in inside):
            parent_name, _, child = name.rpartition(".")
            out.append((drafter_model.get_submodule(parent_name), child, module))
            inside.add(name)
    return out


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
    swapped = _shared_modules(drafter_model, verifier)
    for parent, child, _ in swapped:
        setattr(parent, child, nn.Module())
    try:
        yield tuple(child for _, child, _ in swapped)
    finally:
        for parent, child, module in swapped:
            setattr(parent, child, module)


def _reload(vllm_config, model, verifier, weights, skip: tuple[str, ...] = ()) -> None:
    reload_weights = tp.RELOAD_WEIGHTS.load()
    weights = iter(weights)
    with tp.SET_CURRENT_CONFIG.load()(vllm_config):
        reload_weights(vllm_config, model, weights_iterator=_skipping(weights, skip),
                       weights_path=None, is_checkpoint_format=True)
    for _ in weights:  # the rest of a broadcast, had the loader stopped early
        pass
    # The EAGLE drafter shares the verifier's embed_tokens module, so
    # either reload can untie the verifier's output layer.
    _retie_embeddings(verifier)


def load_weights(vllm_config, verifier: nn.Module, draft: nn.Module | None, weights) -> None:
    """Load a refit in place through vLLM's in-place reload: the policy's
    weights (HF names) into the ``verifier`` where ``draft`` is None, else
    the draft's (vLLM checkpoint names) into ``draft``, skipping the modules
    it shares with the verifier (``_without_shared_modules``). ``weights``:
    an iterator of (name, tensor), consumed to its end (a broadcast's
    buckets arrive through it). Used by ``RefitExtension`` and by the
    weight-transfer engine of ``rayspec.sync.gloo_engine``."""
    if draft is None:
        return _reload(vllm_config, verifier, verifier, weights)
    with _without_shared_modules(draft, verifier) as shared:
        _reload(vllm_config, draft, verifier, weights, skip=shared)


class RefitExtension:
    """Mixed into vLLM's worker; ``self`` is the worker."""

    def rayspec_seed(self, seed: int) -> None:
        """Reseed the worker's random streams: torch's generators, which the
        V1 runner's sampler, rejection sampler and drafters draw from for
        requests without their own seed, and NumPy's, which the V2 runner
        draws those requests' seeds from."""
        import numpy as np
        import torch

        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)

    def rayspec_draft_shared(self) -> list[str]:
        """Attribute names of the drafter's modules that are the verifier's
        (``_shared_modules``; e.g. ``embed_tokens``, ``lm_head``): a draft
        refit's weights under them are left out (the policy refit owns
        them). Empty without a model-based drafter."""
        draft = tp.require(self.model_runner, "get_draft_model", tp.REFIT)()
        return [] if draft is None else [child for _, child, _ in _shared_modules(draft, self.model_runner.get_model())]

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

    def rayspec_index_suffix_text(self, token_ids: list[int]) -> bool:
        """Index ``token_ids`` (e.g. a tool message's tokens) into the suffix
        drafter's cache of other requests' text (Arctic Inference's global
        tree), as a finished response would be: the prompts of running
        requests (where a trajectory's tool outputs are) are each request's
        own, so without this no sibling trajectory drafts from another's tool
        output. It takes one of the ``suffix_decoding_max_cached_requests``
        slots (FIFO eviction, as responses). Returns False, indexing
        nothing, where that cache is off (0).

        Raises:
            VllmInternalsError: the model runner or its suffix proposer lacks
                what vLLM 0.32 has (``drafter``, ``suffix_cache``).
        """
        drafter = tp.require(self.model_runner, "drafter", tp.GROUP_SUFFIX)
        cache = tp.require(drafter, "suffix_cache", tp.GROUP_SUFFIX)
        if cache.max_cached_requests == 0:
            return False
        text = f"rayspec-text-{uuid.uuid4().hex}"  # never a vLLM request id
        cache.start_request(text, [])
        cache.add_active_response(text, token_ids)
        cache.stop_request(text)
        return True

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
        runner = self.model_runner
        draft = None if target == "policy" else tp.require(runner, "get_draft_model", tp.REFIT)()
        if target != "policy" and draft is None:
            raise RuntimeError("this engine has no model-based drafter to update")
        load_weights(self.vllm_config, runner.get_model(), draft, weights)

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
