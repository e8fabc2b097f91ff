"""The Train worker group as one RL step sees it: this rank, the world, and
the few collectives the step needs (objects from rank 0, a barrier)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any


class RunAborted(RuntimeError):
    """The run stops on every Train rank, on an error a restart would meet
    again (a bad input: a reward function that raises, a data file's bad
    row), found on rank 0 (``Ranks.stop_on``). ``rl_worker_loop`` ends the
    workers without a failure, so Ray Train does not restart them to fail
    the same way, and the driver raises it with the message. The message
    starts with the original error's type (``kind``)."""

    @property
    def kind(self) -> str:
        """The original error's type name (``Ranks.stop_on``'s message starts with it)."""
        return str(self).split(":", 1)[0]


def report_aborts(loop):
    """Wrap a Ray Train ``train_loop_per_worker`` (returning nothing): a
    ``RunAborted`` (raised on every rank alike, ``Ranks.stop_on``) ends the
    worker without a failure, returning its message, so Ray Train neither
    restarts the workers (``FailureConfig.max_failures``) nor prints the
    error per attempt; the driver reads rank 0's from ``Result.return_value``."""
    @functools.wraps(loop)
    def wrapped(config):
        try:
            loop(config)
        except RunAborted as e:
            return str(e)

    return wrapped


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

    @contextlib.contextmanager
    def stop_on(self, errors: tuple[type[BaseException], ...]):
        """Run a block of rank 0's work (a no-op on the other ranks), then
        agree (a broadcast): where it raised one of ``errors`` on rank 0,
        every rank raises ``RunAborted`` naming it. Other errors propagate
        as they are (Ray Train restarts the workers for those).

        Raises:
            RunAborted: on every rank, "<error type>: <message>".
        """
        caught = None
        try:
            yield
        except errors as e:
            if not self.is_driver:
                raise
            caught = e
        message = self.broadcast(f"{type(caught).__name__}: {caught}" if caught is not None else None)
        if message is not None:
            raise RunAborted(message) from caught
