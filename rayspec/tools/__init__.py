"""Tools around the RL step that are not stages of it: the statistical test
that speculative sampling is lossless (``lossless``), the
OpenAI-compatible server of a finished run (``endpoint``), and what the
rollout benchmarks share (``bench``)."""
