"""Where and when the roles of the RL step run."""

from rayspec.scheduler.colocate import init_ray, run

__all__ = ["init_ray", "run"]
