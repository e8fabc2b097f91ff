"""The Train worker group as one RL step sees it: this rank, the world, and
the few collectives the step needs (objects from rank 0, a barrier)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Ranks:
    """This process's place among the Train workers.

    Collectives go through ``torch.distributed`` (gloo on CPU, NCCL on GPU:
    the group Ray Train formed); a world of one needs no process group, so
    single-rank runs and tests call the same code without one.

    Args:
        rank: world rank (0 drives the step: rollouts, refits, the record).
        world: number of Train workers.
    """

    rank: int = 0
    world: int = 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; others pass anything)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
