"""Policy update: Ray Train workers holding DeepSpeed ZeRO engines, GRPO loss (the verifier's features for the
draft head are captured in its forward by ``rayspec.draft.capture``)."""
