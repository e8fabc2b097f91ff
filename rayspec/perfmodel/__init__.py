"""Performance model: projects rollout and RL-step speedups of speculative
decoding from a model's shape, the hardware, the workload and the measured
acceptance rates (see docs/performance-model.md).

Analysis only (``jobs.project_speedup``, the benchmarks, the tests): no run
imports it. The run-time memory plan and the model shapes it reads are
``rayspec.memory_plan`` and ``rayspec.model_shape``. Import the submodules
themselves (``pipeline``, ``simulate``, ``calibrate``, ``validate``,
``weight_sync``, ``hardware``); this file imports none of them, so that
reading one preset does not load the simulator and the rollout code it uses.
"""
