"""Tools around the RL step that are not stages of it: the statistical test
that speculative sampling is lossless (``lossless``), the
OpenAI-compatible server of a finished run (``endpoint``), what the
rollout benchmarks share (``bench``), and a Ray cluster of simulated nodes
on one host (``local_cluster``)."""
