"""Where and when the roles of the RL step run: the placement plan
(``placement``), sync/async rollouts with bounded policy lag (``pipeline``)
and the driver that starts everything (``driver``)."""

from rayspec.scheduler.driver import checkpoints, init_ray, run
from rayspec.scheduler.placement import ClusterFitError, PlacementPlan, plan_placement

__all__ = ["ClusterFitError", "PlacementPlan", "checkpoints", "init_ray", "plan_placement", "run"]
