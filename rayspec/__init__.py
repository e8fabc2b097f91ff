"""rayspec: speculative-decoding rollouts for RL post-training on Ray, vLLM and DeepSpeed."""

__version__ = "0.1.0"
