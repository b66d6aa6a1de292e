"""The durable sample queue: the Sample type and its codec, the Redis-Streams queue, the embedded Redis launcher, and
the Arrow/Parquet archive."""

from pipeline.queue.codec import SCHEMA_VERSION, decode_samples, encode_samples
from pipeline.queue.sample import Sample, SampleStatus, SamplingInfo, compact_routing, routing_dtype

__all__ = [
    "SCHEMA_VERSION",
    "Sample",
    "SampleStatus",
    "SamplingInfo",
    "compact_routing",
    "decode_samples",
    "encode_samples",
    "routing_dtype",
]
