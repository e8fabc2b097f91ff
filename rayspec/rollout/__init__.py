"""Rollout stage: vLLM engines with speculative decoding behind Ray Serve."""
