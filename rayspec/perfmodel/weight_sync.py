"""Seconds of one refit by weight transport (``rayspec.sync``): what the
trainer's rank 0 and the replicas copy, and over which link, as rayspec's
code does it. B = weight bytes, N = nodes holding replicas and trainer.

    object_store = B/pcie (gather to host) + B/host (ray.put's pickle into the store)
                 + (N-1) B/tcp (the owner's NIC sends one copy per other node)
                 + 3 B/host (a replica's ray.get, its staging-file write, the loader's read)
                 + B/pcie (the loader's host-to-device copy)
    collective   = sync mode: 2 B/hbm (rank 0 packs each bucket from its own weights
                   on its GPU: rayspec.sync.DeviceGather) + B/link (the pipelined
                   broadcast; every receiver takes it at once; link = NVLink within
                   a node, the GPU's RDMA NIC across nodes);
                   async mode: B/pcie (gather to host) + B/pcie (each bucket back to
                   rank 0's GPU) + B/link
    shared_memory = B/pcie (rank 0 packs the gathered weights into /dev/shm files)
                 + B/pcie (each replica's host-to-device copy from its read-only map);
                   one node only
    cuda_ipc     = max(2 B/hbm (each replica copies its rank's exported weights
                   within the device: a read and a write), B/pcie (rank 0's host
                   copy for a replica that catches up, in parallel; the refit
                   ends when it has landed)); colocated, no gather

Replicas receive in parallel, so neither depends on the replica count (the
object store's sender NIC is shared by the other nodes: the (N-1) term). A
bucket loads on the device as the next one travels: its copy from HBM is
not charged. On the CPU preset "device" and host are the same memory, so
pcie is a host copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayspec.perfmodel.hardware import Hardware

TRANSPORTS = ("object_store", "collective", "shared_memory", "cuda_ipc")


@dataclass(frozen=True)
class SyncTime:
    """One refit's modelled seconds, by part."""

    transport: str
    gather_s: float
    transfer_s: float
    load_s: float

    @property
    def seconds(self) -> float:
        return self.gather_s + self.transfer_s + self.load_s


def sync_time(transport: str, nbytes: float, hw: Hardware, nodes: int = 1, mode: str = "sync") -> SyncTime:
    """Seconds of one refit of ``nbytes`` (see the module docstring).

    Args:
        transport: ``object_store`` | ``collective`` | ``shared_memory`` |
            ``cuda_ipc``.
        nbytes: bytes of the weights sent (bytes).
        hw: the device preset (``pcie_bw``, ``host_copy_bw``, ``link_bw``,
            ``inter_node_bw``, ``tcp_bw``, ``mem_bw``; bytes/s).
        nodes: nodes the trainer's rank 0 and the replicas span (>= 1).
        mode: the pipeline's ``sync`` | ``async`` (the collective sends from
            rank 0's device in sync mode only).

    Raises:
        ValueError: an unknown transport, nodes < 1, or shared_memory across
            nodes.
    """
    if nodes < 1:
        raise ValueError(f"nodes={nodes}: must be >= 1")
    gather = nbytes / hw.pcie_bw
    if transport == "object_store":
        transfer = nbytes / hw.host_copy_bw + (nodes - 1) * nbytes / hw.tcp_bw + 2 * nbytes / hw.host_copy_bw
        load = nbytes / hw.host_copy_bw + nbytes / hw.pcie_bw
    elif transport == "shared_memory":
        if nodes > 1:
            raise ValueError(f"weight transport shared_memory on {nodes} nodes: tmpfs is per host (one node only)")
        transfer, load = 0.0, nbytes / hw.pcie_bw
    elif transport == "cuda_ipc":
        gather, transfer = 0.0, 0.0
        load = max(2 * nbytes / hw.mem_bw, nbytes / hw.pcie_bw)
    elif transport == "collective":
        link = hw.link_bw if nodes == 1 else hw.inter_node_bw
        if mode == "sync":
            gather, transfer = 0.0, 2 * nbytes / hw.mem_bw + nbytes / link
        else:
            transfer = nbytes / hw.pcie_bw + nbytes / link
        load = 0.0
    else:
        raise ValueError(f"weight transport {transport!r}: expected one of {TRANSPORTS}")
    return SyncTime(transport, gather, transfer, load)
