"""The prompt cursor: producers share one pass over a prompt source through Redis, so any number of them take
distinct prompts, a restarted producer continues where the run left off, and prompts the trainer hands back (requeues)
are taken again first. Epochs wrap around."""

from __future__ import annotations

import redis

from pipeline.queue.keys import RunKeys, parse_slot_item, slot_item


class PromptCursor:
    """The run's shared position in the prompt source, in Redis: producers hold no state of their own.

    ``next()`` first takes prompts handed back for another try (a failed generation, a lost producer's groups, or the
    trainer requeueing a stale group), then advances the cursor with INCR, so two producers never take the same
    index. A handed-back prompt is a slot item ``"index:requeues"`` (``pipeline.queue.keys.slot_item``): the count of
    trainer requeues travels with the prompt, so ``staleness.max_requeues`` holds across producers.
    The producer itself takes prompts inside its admission script (atomic with pacing); this class is the same
    protocol from Python, for tools and tests.
    """

    def __init__(self, client: redis.Redis, run: str) -> None:
        keys = RunKeys(run)
        self.redis = client
        self.cursor_key = keys.prompt_cursor
        self.retry_key = keys.prompt_retry

    def next(self) -> tuple[int, bool]:
        """(prompt index, whether it is a retry)."""
        index, _, is_retry = self.take()
        return index, is_retry

    def take(self) -> tuple[int, int, bool]:
        """(prompt index, times the trainer requeued it, whether it is a retry)."""
        retry = self.redis.lpop(self.retry_key)
        if retry is not None:
            index, requeues = parse_slot_item(retry)
            return index, requeues, True
        return int(self.redis.incr(self.cursor_key)) - 1, 0, False

    def give_back(self, index: int, requeues: int = 0) -> None:
        """Hand a prompt index back so the next producer tries it again."""
        self.redis.rpush(self.retry_key, slot_item(index, requeues))

    def position(self) -> int:
        """How many new prompt indices were handed out so far."""
        return int(self.redis.get(self.cursor_key) or 0)

    def retries(self) -> list[tuple[int, int]]:
        """The handed-back prompts waiting, in the order they will be taken: (index, requeues)."""
        return [parse_slot_item(x) for x in self.redis.lrange(self.retry_key, 0, -1)]
