"""Weight sync: how a refit's weights travel from the trainer to every vLLM
worker (``rollout.weight_sync.transport``)."""

from rayspec.sync.transport import (
    CollectiveTransport,
    ObjectStoreTransport,
    WeightSyncError,
    make_transport,
    pack_bucket,
    plan_buckets,
)

__all__ = ["CollectiveTransport", "ObjectStoreTransport", "WeightSyncError", "make_transport",
           "pack_bucket", "plan_buckets"]
