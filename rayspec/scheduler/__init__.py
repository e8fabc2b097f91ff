"""Where and when the roles of the RL step run: the placement plan
(``placement``) and sync/async rollouts with bounded policy lag
(``pipeline``). The run's driver that follows the plan is ``rayspec.driver``."""

from rayspec.scheduler.placement import ClusterFitError, PlacementPlan, plan_placement

__all__ = ["ClusterFitError", "PlacementPlan", "plan_placement"]
