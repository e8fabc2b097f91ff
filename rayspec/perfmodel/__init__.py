"""Performance model: projects rollout and RL-step speedups of speculative
decoding from a model's shape, the hardware, the workload and the measured
acceptance rates (see docs/performance-model.md)."""

from rayspec.perfmodel.hardware import Hardware
from rayspec.perfmodel.pipeline import Pipeline, Workload, rl_step
from rayspec.perfmodel.shapes import ModelShape
from rayspec.perfmodel.simulate import Engine, best_schedule, simulate_rollout

__all__ = ["Engine", "Hardware", "ModelShape", "Pipeline", "Workload", "best_schedule", "rl_step",
           "simulate_rollout"]
