"""Policy update: Ray Train workers holding DeepSpeed ZeRO engines, GRPO loss, feature capture."""
