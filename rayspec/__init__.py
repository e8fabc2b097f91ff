"""rayspec: speculative-decoding rollouts for RL post-training on Ray, vLLM and DeepSpeed.

Its folders and top-level modules import only those of lower layers (peers, split by commas,
import none of each other; ``tests/test_layout.py`` checks it):

devices, files, buckets, model_shape < config, batch < vllm, models, reward, memory_plan, relay < data < sync
< rollout < draft < metrics, tools, tracking < perfmodel, scheduler, console < train < preflight < driver
"""

__version__ = "0.1.0"
