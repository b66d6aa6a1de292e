"""sluice: asynchronous RL post-training around a durable sample queue.

Stages, in dependency order: ``pipeline.queue`` (Sample, codec, Redis-Streams queue, archive) and ``pipeline.sync``
(policy version, weight push) at the bottom; ``pipeline.producers`` (engines, rollouts, rewards) and
``pipeline.consumers`` (staleness, trainer, evaluator, replay) above them.
"""

__version__ = "0.1.0"
