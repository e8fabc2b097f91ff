"""The memory plan of a run: bytes on each kind of device, per phase of the
RL step, and whether they fit, before anything starts.

Every term is a byte count from the model's shape and the run's config;
the accounting and its sources:

- **Model states of a Train rank** (bf16 with fp32 master weights and
  Adam, which is what rayspec's GPU default runs): DeepSpeed 0.19.8's own
  estimators (``estimate_zero2_model_states_mem_needs`` in
  ``runtime/zero/stage_1_and_2.py``, ``estimate_zero3_model_states_mem_needs``
  in ``runtime/zero/stage3.py``; ZeRO paper, Rajbhandari et al. 2020,
  Sec. 3.1): per parameter 2 bytes of bf16 weights, and 18 bytes of bf16
  and fp32 gradients, fp32 master and the two Adam moments, partitioned
  over the N ranks from stage 1 (optimizer) / 2 (gradients too; DeepSpeed
  counts the two together) / 3 (the weights too, plus 4 bytes a parameter
  of the largest module, gathered at once). Stage 1 keeps a whole bf16
  gradient (2 bytes), stage 0 everything. ``offload_optimizer`` moves the
  18 (stage 3: and ``offload_param`` the 2) to host memory.
- **DeepSpeed's buffers**: ``reduce_bucket_size`` and
  ``allgather_bucket_size`` elements (default 5e8 each) of bf16, stages 1-2.
- **Activations** of a micro-batch (b sequences of s tokens), per layer
  34 * s * b * h bytes (Korthikanti et al. 2022, Eq. 1, without the
  5 * a * s / h attention-score term, which flash attention does not
  store); with activation checkpointing a layer keeps its 2 * s * b * h
  input, and one layer's 34 are live during its recompute. The LM head's
  logits, s * b * V, at 10 bytes each: the bf16 logits, their fp32 copy and
  its log-softmax for the token log-probabilities (``train.grpo.token_logprobs``).
- **After the update** (``PolicyWorker.release``, once the weights are
  gathered for the refit): with ``train.offload_states`` the model states
  go to pinned host memory (DeepSpeed's ``offload_states``), else they stay
  and torch's cache is emptied; either way the update's activations and
  logits are given back before the replicas wake.
- **vLLM**: a replica owns ``gpu_memory_utilization`` x the device's
  memory while awake (weights, activations, KV cache: ``vllm/worker/
  gpu_worker.py``'s profile); asleep it keeps nothing on the device (level
  1 keeps its weights in pinned host memory, level 2 drops them); a refit
  wakes the weights only. The KV cache gets what remains after the weights
  and ``ACTIVATION_SHARE`` of the region.
- **DraftTrainer**: the head's trainable weights at 16 bytes a parameter
  (fp32 weight, gradient, two Adam moments) and its LM head over the draft
  vocabulary; while it trains (during the policy update and after the
  refit) also the verifier's embedding in bf16 and the draft
  vocabulary's N rows of its LM head, as rank 0 sends them (``rayspec/draft/
  trainer.py``; the loss casts 8192 rows at a time to fp32,
  ``loss.TARGET_ROWS``), and the target logits of a batch (tokens x N,
  fp32, twice: logits and softmax), given back after. The Train ranks
  take the normalisers over all V tokens (``loss.verifier_normalizers``):
  [tokens, 8192] fp32 blocks beside the update's logits, and under ZeRO-3
  the gathered LM head.
- **Per process**: ``CUDA_CONTEXT`` (CUDA context, cuBLAS workspace, NCCL's
  buffers).

Host memory is summed as if everything were held at once (the policy's
load at start: the memory-mapped checkpoint, shared by a node's ranks,
and a copy per rank where they train in another dtype, but under ZeRO-3;
and the driver's read of the tensors a new draft head starts from; all
over before states are offloaded; rank 0's host copy of what the
DraftTrainer takes of the verifier, and the DraftTrainer's fetched one):
an upper bound.

**CPU roles** (``cpu_plan``): every role lives in host memory, so the plan
is one node's host memory per phase. The terms are the same byte counts
(fp32 training: 4 bytes a weight and 16 a parameter of gradient, fp32
copy and Adam moments, partitioned as above; DeepSpeed's buckets capped at
the model's size; activations at twice Korthikanti's 16-bit figure), plus
what this project measured on its 2-core, 24 GiB machines
(``docs/benchmarks.md``), each a named constant: a vLLM CPU replica's and
a Train worker's own footprint (Python, torch, oneDNN, DeepSpeed, Ray),
and a replica's extra memory while it loads a refit, by transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rayspec.config import draft_online, refit_from_trainer_memory
from rayspec.model_shape import ModelShape

GIB = 2**30
MIB = 2**20
# Memory a device reports (nvidia-smi's total; torch.cuda.get_device_properties
# reports the same bytes). GB200: the datasheet's 186 GB of HBM3e per GPU.
DEVICE_BYTES = {"h100": 81559 * MIB, "h200": 143771 * MIB, "gb200": 186 * 10**9}
# Host memory of one node (DGX H100 / H200: 2 TB; GB200 NVL72 compute tray:
# 2 Grace CPUs x 480 GB LPDDR5X for 4 GPUs).
HOST_BYTES = {"h100": 2 * 10**12, "h200": 2 * 10**12, "gb200": 960 * 10**9}
CUDA_CONTEXT = 1 * GIB  # an assumption: ~0.5 GiB context + cuBLAS workspace + NCCL buffers
ACTIVATION_SHARE = 0.05  # of a replica's region, vLLM's profiled activation peak (an assumption)
LOGIT_BYTES = 10  # bf16 logits + fp32 copy + fp32 log-softmax
PROMPT_TOKENS = 256  # a prompt's tokens, where the config does not bound them
# Rows of the verifier's LM head the draft loss casts to fp32 at a time (rayspec.draft.loss.TARGET_ROWS),
# written out so that the plan, which the launcher runs before anything starts, imports nothing above the
# config; tests/test_memory_plan.py checks that the two agree.
TARGET_ROWS = 8192

# CPU roles, measured (docs/benchmarks.md; the files under docs/benchmarks/):
# a vLLM CPU replica's resident memory beyond its weights and KV space:
# the GSM8K preset's replica (SmolLM2-135M fp32, 0.54 GB; 1 GiB KV) held
# 3.37-3.52 GiB without drafting (rl_memory.json, 24 steps): fitted.
VLLM_CPU_RUNTIME = 2.0 * GIB
# a Train worker's beyond the terms below: one ZeRO-2 rank's isolated
# update with 5e7 buckets (zero_bucket_memory.json, the CPU default) peaked
# at 5.69-5.88 GiB: fitted.
TRAIN_CPU_RUNTIME = 2.0 * GIB
# the DraftTrainer's while it waits: 0.52-0.53 GiB (rl_memory.json): fitted.
DRAFT_CPU_RUNTIME = 0.5 * GIB
# Ray's own processes on the head node (GCS, raylet, dashboard, Serve's
# controller), the driver and the reward workers: an assumption.
RAY_CPU_PROCESSES = 1.5 * GIB
# A replica's extra memory while it loads a refit (bench_refit, refit.json):
# object store, per state-dict byte (ray.get's copy, the safetensors file it
# stages in /dev/shm, vLLM's load): 4.39 at 1 GB, fitted; collective and
# shared_memory, per bucket byte (the received bucket and its unpacked
# views, vLLM's load): 0.65-0.66 GB and 0.63 GB at 256 MiB buckets, fitted.
OBJECT_STORE_REFIT_PER_BYTE = 4.4
BUCKET_REFIT_PER_BYTE = 2.4
# cuda_ipc's CPU twin, per state-dict byte: the pages of rank 0's export the
# replica maps as it loads (shared with the export, so an upper bound) and
# vLLM's load: 0.61 GB at 0.99 GB (refit_transports_quick.json), fitted.
IPC_REFIT_PER_BYTE = 0.62


@dataclass
class Term:
    """One term of a device's or a host's memory: ``bytes`` held by
    ``role`` for ``what``."""

    role: str
    what: str
    bytes: float


@dataclass
class Device:
    """One kind of device in the plan and its terms per phase."""

    name: str
    capacity: float
    count: int
    phases: dict[str, list[Term]] = field(default_factory=dict)

    def used(self, phase: str) -> float:
        return sum(t.bytes for t in self.phases.get(phase, []))


@dataclass
class MemoryPlan:
    """Bytes per device kind and phase, and the host's per node.

    Attributes:
        devices: the device kinds (``colocate``: the device that holds the
            DraftTrainer and the others; ``split``: rollout and train devices).
        host: terms of one node's host memory.
        host_capacity: bytes of one node's host memory.
        notes: the assumptions a reader needs (sequence length, ...).
    """

    devices: list[Device]
    host: list[Term]
    host_capacity: float
    notes: list[str]
    layout_problems: list[str] = field(default_factory=list)
    min_util: float = 0.0  # the gpu_memory_utilization below which a replica's weights leave no KV cache

    PHASES = ("rollout", "policy update", "draft training", "refit")

    def problems(self) -> list[str]:
        """What does not fit: one line each (device, phase, bytes, capacity)."""
        out = list(self.layout_problems)
        for d in self.devices:
            for phase in self.PHASES:
                used = d.used(phase)
                if used > d.capacity:
                    top = max(d.phases[phase], key=lambda t: t.bytes)
                    out.append(f"{d.name}, {phase}: {used / GIB:.1f} GiB > {d.capacity / GIB:.1f} GiB "
                               f"(largest: {top.role} {top.what} {top.bytes / GIB:.1f} GiB)")
        kv = {t.bytes for d in self.devices for t in d.phases.get("rollout", []) if t.what == "KV cache"}
        if kv and min(kv) <= 0:
            out.append(f"replica: its weights leave no memory for the KV cache ({min(kv) / GIB:.1f} GiB): "
                       f"rollout.engine_kwargs.gpu_memory_utilization must exceed {self.min_util:.2f}, or the "
                       "replica be sharded over more devices (rollout.engine_kwargs.tensor_parallel_size with "
                       "rollout.num_gpus_per_replica)")
        host = sum(t.bytes for t in self.host)
        if host > self.host_capacity:
            top = max(self.host, key=lambda t: t.bytes)
            out.append(f"host memory of a node: {host / GIB:.1f} GiB > {self.host_capacity / GIB:.1f} GiB "
                       f"(largest: {top.role} {top.what} {top.bytes / GIB:.1f} GiB)")
        return out

    def table(self) -> str:
        """The plan as text: per device kind, a row per term with a column per phase."""
        lines = []
        for d in self.devices:
            lines.append(f"{d.name} (x{d.count}, {d.capacity / GIB:.1f} GiB)")
            lines.append(f"  {'role':<14} {'term':<34}" + "".join(f"{p:>15}" for p in self.PHASES))
            keys = []
            for phase in self.PHASES:
                for t in d.phases.get(phase, []):
                    if (t.role, t.what) not in keys:
                        keys.append((t.role, t.what))
            for role, what in keys:
                cells = []
                for phase in self.PHASES:
                    b = sum(t.bytes for t in d.phases.get(phase, []) if (t.role, t.what) == (role, what))
                    cells.append(f"{b / GIB:>15.2f}" if b else f"{'-':>15}")
                lines.append(f"  {role:<14} {what:<34}" + "".join(cells))
            lines.append(f"  {'total':<49}" + "".join(
                f"{d.used(p) / GIB:>14.1f}" + ("!" if d.used(p) > d.capacity else " ") for p in self.PHASES))
        if self.host:  # a GPU plan's host memory (a CPU plan's is its one device)
            host = sum(t.bytes for t in self.host)
            lines.append(f"host memory per node ({self.host_capacity / GIB:.0f} GiB): {host / GIB:.1f} GiB"
                         + "".join(f"\n  {t.role:<14} {t.what:<52} {t.bytes / GIB:>8.2f}" for t in self.host))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"devices": [{"name": d.name, "capacity": d.capacity, "count": d.count,
                             "phases": {p: [vars(t) for t in ts] for p, ts in d.phases.items()}}
                            for d in self.devices],
                "host": [vars(t) for t in self.host], "host_capacity": self.host_capacity,
                "notes": self.notes, "problems": self.problems()}


def model_states(total_params: int, largest_module_params: int, stage: int, ranks: int,
                 offload_optimizer: bool = False, offload_param: bool = False) -> tuple[float, float]:
    """(device bytes, host bytes) of one Train rank's model states, bf16
    with fp32 master weights and Adam; DeepSpeed's estimators' accounting
    (module docstring) without their ``additional_buffer_factor``.

    Raises:
        ValueError: a ZeRO stage outside 0-3.
    """
    p, n = total_params, ranks
    if stage == 0:
        return 2 * p + 18 * p, 0.0
    if stage in (1, 2):
        grads = 2 * p if stage == 1 else 0  # stage 1 keeps the whole bf16 gradient
        if offload_optimizer:
            return 2 * p + grads, 18 * p / n
        return 2 * p + grads + 18 * p / n, 0.0
    if stage == 3:
        gathered = 4 * largest_module_params
        if offload_optimizer:
            return (gathered, 20 * p / n) if offload_param else (gathered + 2 * p / n, 18 * p / n)
        return gathered + 18 * p / n, 0.0
    raise ValueError(f"train.deepspeed.zero_optimization.stage={stage}: must be 0, 1, 2 or 3")


def _draft_logits(head: ModelShape, h: int, tokens: int) -> list[Term]:
    """The DraftTrainer's target logits over the draft vocabulary's N tokens
    (fp32, twice: logits and probabilities, ``loss.verifier_targets``)."""
    return [Term("DraftTrainer", "target logits, draft vocab (fp32 x2)",
                 8 * tokens * head.lm_head_params // h)]


NORMALIZERS = "normalisers of all V (fp32 blocks)"


def _verifier_sent(shape: ModelShape, head: ModelShape) -> float:
    """Bytes rank 0 sends the DraftTrainer each step it trains
    (``rayspec.train.policy.verifier_output_weights``): the embedding and
    the draft rows of the LM head in bf16; tied, the embedding alone."""
    h = shape.hidden_size
    return 2 * (shape.vocab_size * h + (0 if shape.tied_embeddings else head.lm_head_params))


def _normalizer_bytes(h: int, tokens: int) -> int:
    """A Train rank's fp32 memory for ``loss.verifier_normalizers``: the
    masked hidden states and two [tokens, TARGET_ROWS] blocks (the logits
    and their scaled copy)."""
    return 4 * tokens * (h + 2 * TARGET_ROWS)


def _dtype_bytes(dtype: str) -> int:
    return 4 if str(dtype) in ("float32", "fp32") else 2


def _zero_config(cfg) -> dict:
    """``train.deepspeed.zero_optimization``, empty where unset."""
    return cfg.train.deepspeed.get("zero_optimization", {}) or {}


def lora_params(cfg, shape: ModelShape) -> int:
    """The adapter's parameters where ``train.lora`` is on (0 otherwise)."""
    lora = cfg.train.lora
    return shape.lora_params(lora.r, lora.target_modules) if lora.enabled else 0


def lora_slot_bytes(cfg, shape: ModelShape) -> float:
    """What a replica's vLLM allocates for LoRA (``enable_lora``): for each
    of ``max_loras`` slots, A and B at ``max_lora_rank`` for every linear
    projection of the decoder layers, the embedding and the LM head
    (vLLM 0.32 wraps them all, whatever an adapter targets), in the serving
    dtype. Bytes."""
    kw = cfg.rollout.engine_kwargs
    rank, slots = int(kw.get("max_lora_rank", cfg.train.lora.r)), int(kw.get("max_loras", 1))
    per_slot = shape.lora_params(rank) + 2 * rank * (shape.vocab_size + shape.hidden_size)
    return slots * per_slot * _dtype_bytes(cfg.model.dtype)


def _module_bytes(cfg) -> int:
    """A weight's bytes in the Train ranks' module, as loaded and trained
    (``rayspec.train.loop.training_load_dtype``)."""
    return 2 if (cfg.train.deepspeed.get("bf16") or {}).get("enabled") else 4


@dataclass(frozen=True)
class _GpuSizes:
    """What a GPU plan's terms are computed from: the run's choices and the
    sizes they give (``_gpu_sizes``)."""

    stage: int
    offload_opt: bool
    ranks: int
    serving_bytes: int  # a weight's bytes in the replicas (model.dtype)
    module_bytes: int  # a weight's bytes in the Train ranks' module
    util: float  # gpu_memory_utilization
    max_len: int
    seq: int  # tokens of a sequence
    micro: int  # sequences of a micro-batch
    region: float  # a replica's share of a device
    weights: float  # a replica's weights
    dev_states: float  # a Train rank's model states on its device
    host_states: float  # and in host memory (offload)
    colocated: bool
    lora_slots: float = 0.0  # a replica's LoRA adapter slots (train.lora)

    @property
    def tokens(self) -> int:
        """Tokens of a micro-batch."""
        return self.micro * self.seq


def _gpu_capacities(device: str, device_bytes: Optional[float], host_bytes: Optional[float]) -> tuple[float, float]:
    """(a device's bytes, a node's host bytes): those given, else the
    ``device`` preset's.

    Raises:
        ValueError: no ``device_bytes`` and an unknown ``device``.
    """
    if device_bytes is None:
        if device not in DEVICE_BYTES:
            raise ValueError(f"--hardware {device}: unknown (one of {', '.join(DEVICE_BYTES)})")
        device_bytes = DEVICE_BYTES[device]
    return device_bytes, host_bytes if host_bytes is not None else HOST_BYTES.get(device, 0)


def _gpu_sizes(cfg, shape: ModelShape, device_bytes: float, prompt_tokens: int) -> _GpuSizes:
    """The sizes of ``cfg``'s GPU plan (``_GpuSizes``).

    Raises:
        ValueError: a config without GPU roles, or a ZeRO stage outside 0-3.
    """
    ro, tr = cfg.rollout, cfg.train
    if ro.num_gpus_per_replica <= 0 or tr.num_gpus_per_worker <= 0:
        raise ValueError("the memory plan is of GPU roles: rollout.num_gpus_per_replica and "
                         "train.num_gpus_per_worker must be > 0")
    zero = _zero_config(cfg)
    stage = int(zero.get("stage", 0))
    offload_opt = str((zero.get("offload_optimizer") or {}).get("device", "none")) == "cpu"
    offload_param = str((zero.get("offload_param") or {}).get("device", "none")) == "cpu"
    rdt = _dtype_bytes(cfg.model.dtype)
    ekw = ro.engine_kwargs
    util = float(ekw.get("gpu_memory_utilization", 0.9))
    max_len = int(ekw.get("max_model_len", prompt_tokens + cfg.grpo.max_new_tokens))
    adapter = lora_params(cfg, shape)
    if adapter:  # the frozen base whole in bf16 beside the adapter's training states
        dev_states, host_states = model_states(adapter, adapter, stage, tr.num_workers, offload_opt, offload_param)
        dev_states += 2 * (shape.total_params - adapter)
    else:
        dev_states, host_states = model_states(shape.total_params, shape.largest_module_params, stage,
                                               tr.num_workers, offload_opt, offload_param)
    return _GpuSizes(stage=stage, offload_opt=offload_opt, ranks=tr.num_workers, serving_bytes=rdt,
                     module_bytes=_module_bytes(cfg), util=util, max_len=max_len,
                     seq=min(max_len, prompt_tokens + cfg.grpo.max_new_tokens),
                     micro=int(tr.deepspeed.get("train_micro_batch_size_per_gpu", 1)), region=util * device_bytes,
                     weights=shape.total_params * rdt, dev_states=dev_states, host_states=host_states,
                     colocated=cfg.scheduler.layout == "colocate",
                     lora_slots=lora_slot_bytes(cfg, shape) if adapter else 0.0)


def _gpu_draft_terms(cfg, shape: ModelShape, s: _GpuSizes) -> tuple[list[Term], list[Term]]:
    """The DraftTrainer's terms on its GPU: (held throughout, while it trains)."""
    h, v = shape.hidden_size, shape.vocab_size
    head = shape.eagle3_head(cfg.draft.draft_vocab_size)
    trainable = head.total_params - head.lm_head_params - head.vocab_size * h  # fc, decoder layer, norms
    resident = [Term("DraftTrainer", "head, gradient, Adam (fp32)", 16 * trainable),
                Term("DraftTrainer", "draft LM head (fp32)", 4 * head.lm_head_params),
                Term("DraftTrainer", "CUDA context", CUDA_CONTEXT)]
    # _train's locals, freed with torch's cache when it returns: only the draft rows go to the device
    training = [Term("DraftTrainer", "embedding + draft rows of LM head (bf16)",
                     2 * (v * h + head.lm_head_params))] + _draft_logits(head, h, s.tokens)
    return resident, training


def _gpu_train_terms(cfg, shape: ModelShape, s: _GpuSizes) -> tuple[list[Term], list[Term], list[Term]]:
    """A Train rank's terms on its GPU: (held throughout, added at the
    update's peak, left after the gather for the refit)."""
    h, v = shape.hidden_size, shape.vocab_size
    zero = _zero_config(cfg)
    ckpt = bool(cfg.train.gradient_checkpointing)
    layer_act = 34 * s.tokens * h
    acts = shape.layers * 2 * s.tokens * h + layer_act if ckpt else shape.layers * layer_act
    buckets = 0 if s.stage in (0, 3) else 2 * (float(zero.get("reduce_bucket_size", 5e8))
                                              + float(zero.get("allgather_bucket_size", 5e8)))
    resident = [Term("Train rank", f"model states (ZeRO-{s.stage})", s.dev_states),
                Term("Train rank", "CUDA context", CUDA_CONTEXT)]
    if buckets:
        resident.append(Term("Train rank", "DeepSpeed buckets", buckets))
    peak = [Term("Train rank", "activations" + (" (checkpointed)" if ckpt else ""), acts),
            Term("Train rank", "logits", LOGIT_BYTES * s.tokens * v)]
    if draft_online(cfg):
        peak.append(Term("Train rank", NORMALIZERS, _normalizer_bytes(h, s.tokens)))
        if s.stage == 3:
            peak.append(Term("Train rank", "LM head gathered for the normalisers", 2 * v * h))
    # after the gather for the refit (PolicyWorker.release): offload_states, or torch's cache emptied
    released = [Term("Train rank", "CUDA context", CUDA_CONTEXT)] if cfg.train.offload_states else resident
    return resident, peak, released


def _replica_terms(s: _GpuSizes) -> tuple[list[Term], list[Term], list[Term]]:
    """A replica's terms on its GPU: (awake, asleep, woken for a refit)."""
    kv = s.region * (1 - ACTIVATION_SHARE) - s.weights - s.lora_slots
    awake = [Term("replica", "weights", s.weights), Term("replica", "activations", s.region * ACTIVATION_SHARE),
             Term("replica", "KV cache", kv), Term("replica", "CUDA context", CUDA_CONTEXT)]
    if s.lora_slots:
        awake.append(Term("replica", "LoRA adapter slots", s.lora_slots))
    asleep = [Term("replica", "CUDA context", CUDA_CONTEXT)]
    refit = [Term("replica", "weights (woken)", s.weights), Term("replica", "CUDA context", CUDA_CONTEXT)]
    return awake, asleep, refit


def _refit_terms(cfg, shape: ModelShape, s: _GpuSizes, train_resident: list[Term],
                 train_released: list[Term]) -> tuple[list[Term], list[Term]]:
    """The refit's terms on a Train rank's GPU: (the transport's, the
    Train rank's own)."""
    if cfg.rollout.weight_sync.transport != "cuda_ipc":
        return [Term("weight sync", "bucket", float(cfg.rollout.weight_sync.packed_buffer_size_bytes))], \
            train_released
    # the replicas read each rank's own weights (rayspec.sync.ipc): its states stay on the device
    # until the refit landed; the export is a copy where the serving dtype is not the module's, and
    # under ZeRO-3 (each parameter is gathered in turn and freed after: full_parameters)
    transport = list(train_resident)
    if s.stage == 3:
        transport.append(Term("Train rank", "one gathered parameter", shape.largest_module_params * s.module_bytes))
    if s.stage == 3 or s.serving_bytes != s.module_bytes:
        transport.append(Term("Train rank", "export (a copy in the serving dtype)",
                              shape.total_params * s.serving_bytes))
    return transport, []


def _gpu_devices(cfg, shape: ModelShape, s: _GpuSizes, device_bytes: float,
                 total: int) -> tuple[list[Device], list[str]]:
    """The plan's kinds of device with their terms per phase, and what the
    layout cannot place (split: more roles than the ``total`` devices)."""
    ro, dr = cfg.rollout, cfg.draft
    train_resident, train_peak, train_released = _gpu_train_terms(cfg, shape, s)
    replica_awake, replica_asleep, replica_refit = _replica_terms(s)
    transport, train_refit = _refit_terms(cfg, shape, s, train_resident, train_released)
    devices, layout_problems = [], []
    with_draft = dr.enabled and dr.num_gpus > 0
    # The DraftTrainer trains on each micro-batch's features as the update
    # makes them; the step waits for it before the refit (rayspec.train.loop.
    # rl_step), the Train ranks still holding what the update left in torch's cache.
    if s.colocated:
        phases = {"rollout": replica_awake + train_released,
                  "policy update": replica_asleep + train_resident + train_peak,
                  "draft training": replica_asleep + train_resident + train_peak,
                  "refit": replica_refit + train_refit + transport}
    else:
        replicas = ro.num_replicas
        devices.append(Device("rollout GPU", device_bytes, replicas, {
            "rollout": replica_awake, "policy update": replica_awake, "draft training": replica_awake,
            "refit": replica_awake + transport}))
        phases = {"rollout": train_released, "policy update": train_resident + train_peak,
                  "draft training": train_resident + train_peak, "refit": train_refit + transport}
        if refit_from_trainer_memory(cfg):
            # NCCL broadcasts rank 0's weights from its device (rayspec.sync.DeviceGather): its states
            # stay there through the refit, with a copy where the serving dtype is not the module's (on
            # every train GPU: the plan's kinds do not single out rank 0's, an upper bound)
            copy = [Term("Train rank", "rank 0: the policy in the serving dtype",
                         shape.total_params * s.serving_bytes)] if s.serving_bytes != s.module_bytes else []
            phases["refit"] = train_resident + copy + transport
        need = replicas * max(1, round(ro.num_gpus_per_replica)) + s.ranks
        if need > total:
            layout_problems.append(f"split layout: {replicas} replicas and {s.ranks} Train ranks need {need} "
                                   f"devices, the cluster has {total}")
    name = "GPU" if s.colocated else "train GPU"
    if with_draft:
        draft_resident, draft_training = _gpu_draft_terms(cfg, shape, s)
        devices.append(Device(f"{name} with the DraftTrainer", device_bytes, 1, {
            ph: ts + draft_resident + (draft_training if ph in ("policy update", "draft training") else [])
            for ph, ts in phases.items()}))
    devices.append(Device(name, device_bytes, (total if s.colocated else s.ranks) - int(with_draft), phases))
    return devices, layout_problems


def _gpu_host_terms(cfg, shape: ModelShape, s: _GpuSizes, nodes: int) -> list[Term]:
    """One node's host memory in a GPU run, everything as if held at once
    (the module docstring)."""
    p, h, v = shape.total_params, shape.hidden_size, shape.vocab_size
    offload = bool(cfg.train.offload_states)
    per_node_replicas = max(1, round(cfg.rollout.num_replicas / nodes))
    per_node_ranks = max(1, round(s.ranks / nodes))
    # transformers memory-maps the checkpoint: loaded in its own dtype, the weights are the mapped
    # file, pages every rank on the node shares; in another dtype each rank copies them. ZeRO-3 builds
    # each rank's partition on its device (rayspec.train.policy.zero3_init), reading the mapped file
    host = [Term("Train workers", "policy checkpoint, memory-mapped (start, shared)",
                 shape.checkpoint_dtype_bytes * p)]
    if s.stage != 3 and s.module_bytes != shape.checkpoint_dtype_bytes:
        host.append(Term("Train workers", f"policy loaded in {'bf16' if s.module_bytes == 2 else 'fp32'} (start)",
                         per_node_ranks * s.module_bytes * p))
    host.append(Term("Ray", "object store", float(cfg.ray.object_store_memory)))
    # the sender keeps the newest policy for replicas that catch up (rayspec.sync)
    if not refit_from_trainer_memory(cfg):
        host.append(Term("Train workers", "rank 0: the newest refit (host copy)", s.weights))
    if draft_online(cfg):  # rank 0's host copy, put; the DraftTrainer's, fetched
        head = shape.eagle3_head(cfg.draft.draft_vocab_size)
        host.append(Term("DraftTrainer", "what rank 0 sends of the verifier (bf16, x2)",
                         2 * _verifier_sent(shape, head)))
    if draft_online(cfg) and not cfg.rollout.speculative_config.model:
        # a new head reads only these (rayspec.draft.eagle3.head_init_tensors), fp32
        host.append(Term("driver", "policy tensors a new draft head starts from (start)",
                         4 * (v * h + h * h + 3 * h * shape.intermediate_size)))
    if s.colocated and cfg.rollout.sleep_level == 1:
        host.append(Term("replicas", "asleep: weights (level 1)", per_node_replicas * s.weights))
    if s.host_states or offload:
        host.append(Term("Train workers", "states in host memory",
                         per_node_ranks * (s.host_states + (s.dev_states if offload else 0))))
    return host


def plan(cfg, shape: ModelShape, device: str, gpus_per_node: int, nodes: int = 1,
         prompt_tokens: int = PROMPT_TOKENS, device_bytes: Optional[float] = None,
         host_bytes: Optional[float] = None) -> MemoryPlan:
    """The memory plan of ``cfg`` (a RunConfig whose roles have GPUs) for
    ``shape`` on ``nodes`` x ``gpus_per_node`` devices of kind ``device``.

    Args:
        cfg: the run's RunConfig (``rayspec.config.load_config``: the GPU
            defaults applied).
        shape: the policy's shape (``ModelShape.from_hf_config``).
        device: a key of ``DEVICE_BYTES`` (ignored where ``device_bytes``
            is given, e.g. a real device's total memory).
        prompt_tokens: a prompt's length in tokens (the config bounds only
            the response, ``grpo.max_new_tokens``).

    Raises:
        ValueError: an unknown device, a config without GPU roles, or a
            ZeRO stage outside 0-3 (named).
    """
    device_bytes, host_bytes = _gpu_capacities(device, device_bytes, host_bytes)
    s = _gpu_sizes(cfg, shape, device_bytes, prompt_tokens)
    devices, layout_problems = _gpu_devices(cfg, shape, s, device_bytes, gpus_per_node * nodes)
    host = _gpu_host_terms(cfg, shape, s, nodes)
    notes = [f"{shape.name}: {shape.total_params / 1e9:.2f}B parameters; a sequence of {s.seq} tokens "
             f"({prompt_tokens} prompt + {cfg.grpo.max_new_tokens} response, max_model_len {s.max_len}), "
             f"micro-batch {s.micro}; vLLM {s.util:.2f} of each device; ZeRO-{s.stage} over {s.ranks} ranks"
             + (", optimizer offloaded" if s.offload_opt else "")]
    return MemoryPlan(devices, host, host_bytes, notes, layout_problems,
                      min_util=s.weights / ((1 - ACTIVATION_SHARE) * device_bytes))


def refit_host_bytes(transport: str, state_dict_bytes: float, bucket_bytes: float) -> float:
    """A CPU replica's extra host memory while it loads a refit of
    ``state_dict_bytes`` through ``transport`` (``object_store``,
    ``collective``, ``shared_memory``, ``cuda_ipc``; ``auto`` is
    ``collective`` on CPUs), from this project's measurements
    (``OBJECT_STORE_REFIT_PER_BYTE``, ``BUCKET_REFIT_PER_BYTE``,
    ``IPC_REFIT_PER_BYTE``). Bytes."""
    if transport == "object_store":
        return OBJECT_STORE_REFIT_PER_BYTE * state_dict_bytes
    if transport == "cuda_ipc":
        return IPC_REFIT_PER_BYTE * state_dict_bytes
    return BUCKET_REFIT_PER_BYTE * min(bucket_bytes, state_dict_bytes)




def _cpu_train_terms(cfg, shape: ModelShape, stage: int, ranks: int, tokens: int) -> tuple[list[Term], list[Term]]:
    """A CPU node's Train workers (``ranks`` of them): (held throughout,
    added in the update). A LoRA policy: the weights whole, the training
    states (gradient, fp32 copy, Adam) of its adapter alone, no reference."""
    tr, ds, zero = cfg.train, cfg.train.deepspeed, _zero_config(cfg)
    p, h, v = shape.total_params, shape.hidden_size, shape.vocab_size
    wb = _module_bytes(cfg)
    rest = 18 if wb == 2 else 16  # gradient, fp32 copy, Adam moments (+ bf16 gradient)
    n = tr.num_workers
    trained = lora_params(cfg, shape) or p
    frozen = wb * p if trained != p else 0
    states = frozen + {0: (wb + rest) * trained, 1: wb * trained + wb * trained + (rest - wb) * trained / n,
                       2: wb * trained + rest * trained / n, 3: (wb + rest) * trained / n}[stage]
    layer_act = 34 * (wb // 2) * tokens * h
    acts = shape.layers * 2 * tokens * h * (wb // 2) + layer_act if tr.gradient_checkpointing \
        else shape.layers * layer_act
    bucket_elems = min(float(zero.get("reduce_bucket_size", 5e8)), trained) + \
        min(float(zero.get("allgather_bucket_size", 5e8)), trained)
    what = f"ZeRO-{stage}, {'bf16' if wb == 2 else 'fp32'}" + (f", LoRA r={tr.lora.r}" if frozen else "")
    train = [Term("Train workers", f"model states ({what})", ranks * states),
             Term("Train workers", "process (measured)", ranks * TRAIN_CPU_RUNTIME)]
    if stage in (1, 2):
        train.append(Term("Train workers", "DeepSpeed buckets", ranks * wb * bucket_elems))
    if cfg.grpo.kl_coef > 0 and not frozen:  # a LoRA policy's reference is itself, the adapter off
        train.append(Term("Train workers", "reference model", ranks * wb * p))
    update = [Term("Train workers", "activations" + (" (checkpointed)" if tr.gradient_checkpointing else ""),
                   ranks * acts),
              Term("Train workers", "logits (+ log-softmax)", ranks * (wb + 4) * tokens * v)]
    return train, update


def _cpu_replica_terms(cfg, shape: ModelShape, replicas: int) -> tuple[list[Term], list[Term]]:
    """A CPU node's replicas (``replicas`` of them): (held throughout,
    added by a refit, with rank 0's copy of what it sends)."""
    ro = cfg.rollout
    rdt = _dtype_bytes(cfg.model.dtype)
    adapter = lora_params(cfg, shape)
    refit_bytes = (adapter or shape.total_params) * rdt
    replica = [Term("replicas", "weights", replicas * shape.total_params * rdt),
               Term("replicas", "KV cache (cpu_kvcache_space_gib)", replicas * ro.cpu_kvcache_space_gib * GIB),
               Term("replicas", "process (measured)", replicas * VLLM_CPU_RUNTIME)]
    if adapter:
        replica.append(Term("replicas", "LoRA adapter slots", replicas * lora_slot_bytes(cfg, shape)))
    transport = "collective" if ro.weight_sync.transport == "auto" else ro.weight_sync.transport
    if adapter:  # rayspec.sync.lora: the adapter through the object store
        transport = "object_store"
    refit = [Term("replicas", f"loading a refit ({transport}, measured)",
                  replicas * refit_host_bytes(transport, refit_bytes, ro.weight_sync.packed_buffer_size_bytes))]
    # the collective in sync mode sends rank 0's own weights (rayspec.sync.DeviceGather): a copy only
    # where the serving dtype is not the training one
    if not (refit_from_trainer_memory(cfg) and rdt == _module_bytes(cfg)):
        refit.append(Term("Train workers", "rank 0: the export (shared memory)" if transport == "cuda_ipc"
                          else "rank 0: the gathered weights", refit_bytes))
    return replica, refit




def _cpu_draft_terms(cfg, shape: ModelShape, replicas: int, ranks: int,
                     tokens: int) -> tuple[list[Term], list[Term], Term]:
    """An online EAGLE-3 head on a CPU node: (held throughout, added while
    the DraftTrainer trains, the Train workers' normalisers in the update)."""
    h, v = shape.hidden_size, shape.vocab_size
    head = shape.eagle3_head(cfg.draft.draft_vocab_size)
    trainable = head.total_params - head.lm_head_params - head.vocab_size * h
    draft = [Term("DraftTrainer", "head, gradient, Adam (fp32)", 16 * trainable),
             Term("DraftTrainer", "draft LM head (fp32)", 4 * head.lm_head_params),
             Term("DraftTrainer", "process (measured)", DRAFT_CPU_RUNTIME),
             Term("replicas", "draft head", replicas * _dtype_bytes(cfg.model.dtype) * head.total_params)]
    # a CPU DraftTrainer fetches them into its heap, trimmed when train returns
    training = [Term("DraftTrainer", "verifier embedding + draft rows of LM head (bf16, fetched)",
                     2 * (v * h + head.lm_head_params))] + _draft_logits(head, h, tokens)
    return draft, training, Term("Train workers", NORMALIZERS, ranks * _normalizer_bytes(h, tokens))


def cpu_plan(cfg, shape: ModelShape, host_bytes: float, nodes: int = 1,
             prompt_tokens: int = PROMPT_TOKENS) -> MemoryPlan:
    """The memory plan of ``cfg`` with CPU roles (no GPU asked for): one
    node's host memory per phase of the RL step, as one "device" of the
    plan (see the module docstring for the terms and their sources).

    Args:
        cfg: the run's RunConfig.
        shape: the policy's shape (``ModelShape.from_hf_config``).
        host_bytes: one node's memory (bytes), e.g. ``psutil.virtual_memory().total``.
        nodes: nodes the roles spread over (each holds its share).
        prompt_tokens: a prompt's length in tokens.

    Raises:
        ValueError: a config whose roles ask for GPUs, or a ZeRO stage
            outside 0-3 (named).
    """
    ro, tr = cfg.rollout, cfg.train
    if ro.num_gpus_per_replica > 0 or tr.num_gpus_per_worker > 0:
        raise ValueError("cpu_plan is of CPU roles: rollout.num_gpus_per_replica and train.num_gpus_per_worker "
                         "must be 0 (plan() plans GPUs)")
    stage = int(_zero_config(cfg).get("stage", 0))
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"train.deepspeed.zero_optimization.stage={stage}: must be 0-3")
    ranks = max(1, round(tr.num_workers / nodes))
    replicas = max(1, round(ro.num_replicas / nodes))
    seq = prompt_tokens + cfg.grpo.max_new_tokens
    tokens = int(tr.deepspeed.get("train_micro_batch_size_per_gpu", 1)) * seq
    train, update = _cpu_train_terms(cfg, shape, stage, ranks, tokens)
    replica, refit = _cpu_replica_terms(cfg, shape, replicas)
    common = [Term("Ray", "object store", float(cfg.ray.object_store_memory)),
              Term("Ray", "Ray's processes, driver, reward workers", RAY_CPU_PROCESSES)]
    draft, draft_training = [], []
    if draft_online(cfg):
        draft, draft_training, normalizers = _cpu_draft_terms(cfg, shape, replicas, ranks, tokens)
        update.append(normalizers)
    base = common + replica + train + draft
    phases = {"rollout": base, "policy update": base + update + draft_training,
              "draft training": base + draft_training, "refit": base + refit}
    notes = [f"{shape.name}: {shape.total_params / 1e9:.2f}B parameters; CPU roles on {nodes} node(s): {replicas} "
             f"replica(s) and {ranks} Train worker(s) a node; a sequence of {seq} tokens; ZeRO-{stage} over "
             f"{tr.num_workers} ranks; the measured terms are of this project's 2-core machines (vLLM 0.32 CPU, "
             "DeepSpeed 0.19.8)"]
    return MemoryPlan([Device("host memory of a node", host_bytes, nodes, phases)], [], host_bytes, notes)


# Knobs tried, in order, when a plan does not fit: each is a list of config
# overrides, and the first few that make it fit are named.
KNOBS: list[tuple[str, list[str]]] = [
    ("states offloaded between updates", ["train.offload_states=true"]),
    ("ZeRO-3", ["train.deepspeed.zero_optimization.stage=3"]),
    ("optimizer offload", ["train.deepspeed.zero_optimization.offload_optimizer.device=cpu"]),
    ("ZeRO-3 + optimizer offload", ["train.deepspeed.zero_optimization.stage=3",
                                    "train.deepspeed.zero_optimization.offload_optimizer.device=cpu"]),
    ("activation checkpointing", ["train.gradient_checkpointing=true"]),
    ("micro-batch 1", ["train.deepspeed.train_micro_batch_size_per_gpu=1"]),
    ("vLLM 0.35 of a device", ["rollout.engine_kwargs.gpu_memory_utilization=0.35"]),
]


# The same for CPU roles (``cpu_plan``).
CPU_KNOBS: list[tuple[str, list[str]]] = [
    ("refits through the collective transport", ["rollout.weight_sync.transport=collective"]),
    ("no reference model", ["grpo.kl_coef=0"]),
    ("one Train worker", ["train.num_workers=1"]),
    ("ZeRO-3", ["train.deepspeed.zero_optimization.stage=3"]),
    ("activation checkpointing", ["train.gradient_checkpointing=true"]),
    ("micro-batch 1", ["train.deepspeed.train_micro_batch_size_per_gpu=1"]),
]


def fixes(config_path: Optional[str], overrides: list[str], shape: ModelShape, device: str,
          gpus_per_node: int, nodes: int, **kw: Any) -> list[str]:
    """The knobs of ``KNOBS`` (``CPU_KNOBS`` where ``device`` is ``cpu``:
    ``kw`` then holds ``host_bytes``) as override strings, that make a plan
    fit."""
    from rayspec.config import ConfigError, load_config

    out = []
    for name, extra in CPU_KNOBS if device == "cpu" else KNOBS:
        try:
            cfg = load_config(config_path, [*overrides, *extra])
            fitted = cpu_plan(cfg, shape, nodes=nodes, **kw) if device == "cpu" else \
                plan(cfg, shape, device, gpus_per_node, nodes, **kw)
            if not fitted.problems():
                out.append(f"{name}: {' '.join(extra)}")
        except (ConfigError, ValueError):
            continue
    return out
