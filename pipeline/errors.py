"""The exception hierarchy. Every error sluice raises on purpose is a ``SluiceError``."""

from __future__ import annotations


class SluiceError(Exception):
    """Base of every error sluice raises on purpose."""


class ConfigError(SluiceError):
    """A recipe or option is invalid; raised before anything starts."""


class QueueError(SluiceError):
    """The sample queue cannot do what was asked (Redis unreachable, bad group, ...)."""


class QueueFullError(QueueError):
    """``put`` waited past its timeout for the trainer group to catch up (backpressure)."""


class PutAbortedError(QueueError):
    """``put`` was told to give up while it waited for room; nothing was written."""


class SampleError(SluiceError):
    """A Sample is malformed; the message names the field and what is wrong with it."""


class SampleDecodeError(SampleError):
    """Bytes read from the queue or archive do not decode into valid Samples."""


class RedisUnavailableError(QueueError):
    """No Redis server could be found or started."""


class SyncError(SluiceError):
    """A weight push or policy-version update failed."""


class EngineError(SluiceError):
    """A rollout engine failed or answered with an error."""
