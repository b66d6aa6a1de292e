"""Rewards: built-in verifiers for the synthetic tasks, user functions named by import path, and reward services.

A producer scores each prompt group through one ``RewardScorer`` (``setup_scorer``), which is one of:

- ``SampleScorer``: a per-sample function ``(prompt, response_text) -> float | (float, info)``, sync or async
  (``producer.reward``: a built-in name or ``package.module:function``);
- ``GroupScorer``: a group function ``(prompt, responses: list[str]) -> list[float | (float, info)]``, sync or async,
  for judges whose score of a response depends on the others (pairwise, ranking, generative;
  ``producer.group_reward``);
- ``HttpScorer``: a reward service (a reward-model server) that takes one JSON POST per group
  (``producer.reward_url``; the protocol is in ``HttpScorer``'s docstring), retried with backoff on connection
  errors, timeouts and 5xx answers.

Every call (a sample's, a group's, an HTTP attempt) holds one permit of the scorer's semaphore
(``producer.reward_concurrency``), shared by all the producer's groups, and runs under ``producer.reward_timeout_s``.
User functions are resolved and checked when the recipe loads, so a typo fails before anything starts. At run time a
call that raises, runs past its timeout, returns something malformed or finds the service down does not stop the
producer: the samples are marked ``failed`` with the error in ``reward_info``, and counted (``RewardStats``, in the
producer's metrics as ``reward_*``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from pipeline.config.producer import GROUP_REWARD_SIGNATURE, REWARD_SIGNATURE, RewardConfig, expand_env
from pipeline.data.prompts import Prompt
from pipeline.errors import ConfigError, SluiceError
from pipeline.plugins import resolve

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__name__)

RewardValue = float | tuple[float, dict[str, Any]]
RewardFn = Callable[[Prompt, str], RewardValue | Awaitable[RewardValue]]
GroupRewardFn = Callable[[Prompt, list[str]], Sequence[RewardValue] | Awaitable[Sequence[RewardValue]]]


def _answer_of(prompt: Prompt) -> str:
    if prompt.answer is None:
        raise ValueError(f"prompt {prompt.prompt_id!r} has no answer to check against")
    return prompt.answer.strip()


def exact_match(prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
    """1 if the response, up to its first newline and without surrounding space, equals the answer."""
    got = response.split("\n", 1)[0].strip()
    ok = got == _answer_of(prompt)
    return float(ok), {"pass": ok}


_NUMBER = re.compile(r"-?\d+")


def integer_match(prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
    """1 if the first integer in the response equals the answer; a partial credit of 0.1 for a well-formed integer.

    The shaping term gives a tiny model something to climb before it gets any answer right.
    """
    m = _NUMBER.match(response.strip())
    if m is None:
        return 0.0, {"pass": False, "parsed": False}
    ok = m.group(0) == _answer_of(prompt)
    return (1.0 if ok else 0.1), {"pass": ok, "parsed": True}


def prefix_match(prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
    """The fraction of the answer's characters the response gets right, in place (dense reward for copy/reverse)."""
    answer = _answer_of(prompt)
    got = response.split("\n", 1)[0].strip()
    right = sum(1 for a, b in zip(answer, got) if a == b)
    score = right / max(len(answer), len(got), 1)
    return score, {"pass": got == answer}


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "integer_match": integer_match,
    "prefix_match": prefix_match,
}


_INLINE = frozenset(BUILTIN_REWARDS.values())


def resolve_reward(spec: str, field: str = "producer.reward") -> RewardFn:
    """A built-in name or ``package.module:function`` (``pipeline.plugins``); ConfigError says what is wrong."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ConfigError(f"{field} = {spec!r} is neither a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) nor an "
                          "import path 'package.module:function'")
    return resolve(spec, field=field, signature=REWARD_SIGNATURE)


@dataclass
class RewardOutcome:
    """A scored sample: the reward, its info, and whether scoring failed (and if so, by running out of time)."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    failed: bool = False
    timed_out: bool = False


async def score(fn: RewardFn, prompt: Prompt, response: str, timeout_s: float) -> RewardOutcome:
    """Run a reward function with a timeout; a raise, a timeout or a non-finite value gives a failed outcome."""
    try:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(prompt, response), timeout_s)  # type: ignore[arg-type]
        elif fn in _INLINE:
            # The built-ins are a few string operations: a thread hop per sample would cost more than they do.
            value = fn(prompt, response)
        else:
            # A thread keeps a slow sync verifier from stalling the event loop; a hung one is abandoned, not joined.
            value = await asyncio.wait_for(_in_own_thread(fn, prompt, response), timeout_s)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout_s)
    except TimeoutError:
        hung = _running_calls() - 1  # this call's own thread still runs too
        return RewardOutcome(0.0, {"error": f"reward function timed out after {timeout_s}s"
                                   + (f" ({hung} other timed-out calls still running)" if hung > 0 else "")},
                             failed=True, timed_out=True)
    except Exception as e:  # a user's function may raise anything; the producer must go on
        return RewardOutcome(0.0, {"error": f"{type(e).__name__}: {e}"[:500]}, failed=True)
    return outcome_of(value, "reward function")


def outcome_of(value: Any, source: str) -> RewardOutcome:
    """A returned reward (a float, or ``(float, info)``) as an outcome; anything else, or a non-finite float, is a
    failed one whose error names ``source``."""
    info: dict[str, Any] = {}
    if isinstance(value, tuple):
        value, info = value
    try:
        reward = float(value)
    except (TypeError, ValueError):
        return RewardOutcome(0.0, {"error": f"{source} returned {type(value).__name__}, not a float"}, failed=True)
    if not math.isfinite(reward):
        return RewardOutcome(0.0, {"error": f"{source} returned {reward}"}, failed=True)
    return RewardOutcome(reward, _json_safe(info))


_RUNNING = [0]  # sync reward calls whose thread has not returned, hung ones included
_RUNNING_LOCK = threading.Lock()


def _running_calls() -> int:
    return _RUNNING[0]


async def _in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread of its own, not the loop's shared pool.

    A verifier that hangs on some input then holds only its own thread. In the shared pool (a handful of workers:
    six on two cores) six hung calls took every worker, and every later sample timed out waiting for one, however
    fast its own call would have been. A daemon thread also does not hold up the process's exit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # timed out: nobody waits for it any more
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def call() -> None:
        value, error = None, None
        try:
            value = fn(*args)
        except BaseException as e:  # handed to the awaiting coroutine, which turns it into a failed outcome
            error = e
        finally:
            with _RUNNING_LOCK:
                _RUNNING[0] -= 1
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:
            pass  # the loop has closed since: the producer stopped while this call hung

    with _RUNNING_LOCK:
        _RUNNING[0] += 1
    threading.Thread(target=call, name="reward", daemon=True).start()
    return await future


def _json_safe(info: Any) -> dict[str, Any]:
    if not isinstance(info, dict):
        return {"info": str(info)}
    out: dict[str, Any] = {}
    for k, v in info.items():
        out[str(k)] = v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Scorers
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class RewardStats:
    """Counters of a scorer's life (the producer reports them as ``reward_<name>``)."""

    calls: int = 0
    """Calls made: per-sample function calls, group function calls, HTTP attempts (retries included)."""
    samples_failed: int = 0
    """Samples marked failed (any reason below)."""
    timeouts: int = 0
    """Calls that ran past reward_timeout_s (HTTP attempts included, even those retried)."""
    errors: int = 0
    """Calls that raised or returned something unusable, and HTTP groups given up on."""
    retries: int = 0
    """HTTP attempts repeated after a connection error, a timeout or a 5xx."""


class _FailureLog:
    """Logs the first failure of each kind, then at most one summary a minute: a broken verifier must be seen, and
    must not flood the log with one line per sample."""

    def __init__(self, what: str, every_s: float = 60.0) -> None:
        self.what, self.every_s = what, every_s
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def failed(self, kind: str, message: str) -> None:
        now = time.monotonic()
        self._since[kind] = self._since.get(kind, 0) + 1
        last = self._last.get(kind)
        if last is None or now - last >= self.every_s:
            more = f" ({self._since[kind] - 1} more since the last report)" if last is not None else ""
            log.warning("%s: %s%s; its samples are marked failed and the producer goes on", self.what, message, more)
            self._last[kind], self._since[kind] = now, 0


class RewardScorer(ABC):
    """Scores one prompt group at a time; every call holds one permit of a semaphore shared by all groups."""

    def __init__(self, *, timeout_s: float, concurrency: int, what: str) -> None:
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.stats = RewardStats()
        self._failures = _FailureLog(what)
        # Made lazily, per event loop: a semaphore belongs to the loop that first waits on it, and a scorer may be
        # built outside the loop that uses it (or used by a later one, as a test's successive asyncio.run calls).
        self._gate: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    @property
    def gate(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._gate is None or self._gate[0] is not loop:
            self._gate = (loop, asyncio.Semaphore(self.concurrency))
        return self._gate[1]

    @abstractmethod
    async def score_group(self, prompt: Prompt, responses: Sequence[str]) -> list[RewardOutcome]:
        """One outcome per response, in order; never raises for a failing reward (cancellation aside)."""

    async def close(self) -> None:  # noqa: B027 - optional: only a scorer that holds connections overrides it
        """Release connections (the HTTP scorer's session)."""

    def _all_failed(self, n: int, kind: str, error: str, *, timed_out: bool = False) -> list[RewardOutcome]:
        self.stats.samples_failed += n
        self._failures.failed(kind, error)
        return [RewardOutcome(0.0, {"error": error[:500]}, failed=True, timed_out=timed_out) for _ in range(n)]

    def _count(self, outcomes: list[RewardOutcome]) -> list[RewardOutcome]:
        for o in outcomes:
            if o.failed:
                self.stats.samples_failed += 1
                self._failures.failed("timeout" if o.timed_out else "error", str(o.info.get("error")))
        return outcomes


class SampleScorer(RewardScorer):
    """A per-sample function, each sample's call under the shared cap and the timeout (``score``)."""

    def __init__(self, fn: RewardFn, *, timeout_s: float, concurrency: int) -> None:
        super().__init__(timeout_s=timeout_s, concurrency=concurrency,
                         what=f"reward {getattr(fn, '__qualname__', fn)!s}")
        self.fn = fn

    async def score_group(self, prompt: Prompt, responses: Sequence[str]) -> list[RewardOutcome]:
        return self._count(list(await asyncio.gather(*(self._one(prompt, r) for r in responses))))

    async def _one(self, prompt: Prompt, response: str) -> RewardOutcome:
        async with self.gate:
            self.stats.calls += 1
            outcome = await score(self.fn, prompt, response, self.timeout_s)
        self.stats.timeouts += outcome.timed_out
        self.stats.errors += outcome.failed and not outcome.timed_out
        return outcome


class GroupScorer(RewardScorer):
    """A group function: one call per group with every response, returning one reward per response."""

    def __init__(self, fn: GroupRewardFn, *, timeout_s: float, concurrency: int, name: str = "group_reward") -> None:
        super().__init__(timeout_s=timeout_s, concurrency=concurrency, what=f"producer.group_reward {name}")
        self.fn, self.name = fn, name

    async def score_group(self, prompt: Prompt, responses: Sequence[str]) -> list[RewardOutcome]:
        n = len(responses)
        async with self.gate:
            self.stats.calls += 1
            try:
                values = await asyncio.wait_for(self._call(prompt, list(responses)), self.timeout_s)
            except TimeoutError:
                self.stats.timeouts += 1
                return self._all_failed(n, "timeout", f"group reward {self.name} timed out after "
                                        f"{self.timeout_s}s", timed_out=True)
            except Exception as e:  # a user's judge may raise anything; the producer must go on
                self.stats.errors += 1
                return self._all_failed(n, "error", f"group reward {self.name} raised {type(e).__name__}: {e}")
        if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence) or len(values) != n:
            self.stats.errors += 1
            got = f"{len(values)} values" if isinstance(values, Sequence) else type(values).__name__
            return self._all_failed(n, "shape", f"group reward {self.name} returned {got} for {n} responses; it "
                                    "must return a list with one float (or (float, info)) per response")
        return self._count([outcome_of(v, f"group reward {self.name}") for v in values])

    async def _call(self, prompt: Prompt, responses: list[str]) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(prompt, responses)  # type: ignore[misc]
        # A slow judge in its own thread keeps the producer's loop (generation, puts) running meanwhile.
        value = await _in_own_thread(self.fn, prompt, responses)
        return await value if inspect.isawaitable(value) else value


class RewardServiceUnavailable(SluiceError):
    """The reward service did not answer (connection error, timeout) or answered 5xx: worth another attempt."""


class RewardServiceTimeout(RewardServiceUnavailable):
    """An attempt ran past ``reward_timeout_s``."""


class RewardServiceRefused(SluiceError):
    """The reward service answered 4xx or something that is not the protocol's reply: another attempt would too."""


class HttpScorer(RewardScorer):
    """A reward service over HTTP: one JSON POST per prompt group.

    Request body::

        {"prompt_id": "p17", "prompt": "12+30=", "prompt_ids": null, "answer": "42",
         "responses": ["42", "41", "4"]}

    (``prompt`` is null for a prompt given as token ids, ``prompt_ids`` null for a text one; ``answer`` null when the
    prompt source has none.) Reply, status 200, ``application/json``::

        {"rewards": [1.0, 0.0, 0.0], "infos": [{"pass": true}, {}, {}]}

    ``rewards`` has one number per response, in order; ``infos`` is optional (one object per response, kept in each
    sample's ``reward_info``). A connection error, a timeout (``reward_timeout_s`` per attempt) or a 5xx answer is
    retried ``reward_retries`` times with exponential backoff; a 4xx answer or a reply of another shape is not. Either
    way, once given up, the group's samples are marked failed and counted, and the producer goes on.

    Credentials (a password in the URL, header values) never appear in logs or errors: the URL is shown redacted and
    header values not at all.
    """

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None, timeout_s: float, concurrency: int,
                 retries: int = 3, backoff_s: float = 0.2) -> None:
        from pipeline.producers.sglang_client import ExponentialBackoff, Retry
        from pipeline.queue.connection import redact_url

        self.url = url
        # What logs and errors show: the password redacted, and the query string (API keys) left out altogether.
        parts = urlsplit(redact_url(url))
        self.public_url = urlunsplit(parts._replace(query="***" if parts.query else ""))
        super().__init__(timeout_s=timeout_s, concurrency=concurrency, what=f"reward service {self.public_url}")
        self.headers = dict(headers or {})
        if self.public_url != url and any(k.lower() == "authorization" for k in self.headers):
            raise ConfigError(f"reward service {self.public_url}: the URL carries credentials (sent as HTTP Basic "
                              "auth) and an Authorization header is set too; keep one of the two")
        self.retry = Retry(backoff=ExponentialBackoff(base=backoff_s, cap=30.0), retries=retries,
                           retry_on=(RewardServiceUnavailable,))
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    async def score_group(self, prompt: Prompt, responses: Sequence[str]) -> list[RewardOutcome]:
        n = len(responses)
        body = {"prompt_id": prompt.prompt_id, "prompt": prompt.text,
                "prompt_ids": None if prompt.input_ids is None else [int(t) for t in prompt.input_ids],
                "answer": prompt.answer, "responses": list(responses)}
        attempts = [0]

        def failed_attempt(exc: BaseException) -> None:
            attempts[0] += 1
            self.stats.timeouts += isinstance(exc, RewardServiceTimeout)

        try:
            reply = await self.retry.call(lambda: self._post(body), on_failure=failed_attempt)
        except RewardServiceUnavailable as e:
            self.stats.retries += attempts[0] - 1
            self.stats.errors += 1
            return self._all_failed(n, "unavailable", f"{e} (gave up after {attempts[0]} attempts)")
        except RewardServiceRefused as e:
            self.stats.retries += attempts[0]
            self.stats.errors += 1
            return self._all_failed(n, "refused", str(e))
        self.stats.retries += attempts[0]
        return self._parse(reply, n)

    def _parse(self, reply: Any, n: int) -> list[RewardOutcome]:
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        infos = reply.get("infos") if isinstance(reply, dict) else None
        if infos is None and isinstance(rewards, list):
            infos = [{}] * len(rewards)
        if not isinstance(rewards, list) or len(rewards) != n or not isinstance(infos, list) or len(infos) != n:
            self.stats.errors += 1
            return self._all_failed(n, "shape", f"reward service {self.public_url} answered without "
                                    f"{n} 'rewards' (and 'infos', if any): {str(reply)[:200]}")
        return self._count([outcome_of((r, i if isinstance(i, dict) else {"info": i}),
                                       f"reward service {self.public_url}") for r, i in zip(rewards, infos)])

    async def _post(self, body: dict[str, Any]) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self.gate:
            self.stats.calls += 1
            try:
                async with self._session_for_loop().post(self.url, json=body, headers=self.headers,
                                                         timeout=timeout) as resp:
                    status, raw = resp.status, await resp.read()
            except TimeoutError:
                raise RewardServiceTimeout(f"reward service {self.public_url} timed out after "
                                               f"{self.timeout_s}s") from None
            except aiohttp.ClientError as e:
                # The exception's text may quote the URL, password included: name the kind only.
                raise RewardServiceUnavailable(f"reward service {self.public_url} did not answer "
                                               f"({type(e).__name__})") from None
            except ValueError as e:  # aiohttp refusing the request itself (a bad header): no attempt would pass
                raise RewardServiceRefused(f"reward service {self.public_url}: the request could not be sent "
                                           f"({type(e).__name__})") from None
        if status >= 500:
            raise RewardServiceUnavailable(f"reward service {self.public_url} answered {status}")
        if status != 200:
            raise RewardServiceRefused(f"reward service {self.public_url} refused the request with {status}: "
                                       f"{raw[:200].decode(errors='replace')}")
        try:
            return json.loads(raw)
        except ValueError:
            raise RewardServiceRefused(f"reward service {self.public_url} answered something that is not JSON: "
                                       f"{raw[:200].decode(errors='replace')}") from None

    def _session_for_loop(self) -> aiohttp.ClientSession:
        import aiohttp

        # A session belongs to the loop it was made in: made lazily, inside the loop that uses it. One left by a loop
        # that has ended cannot be closed from this one; it is dropped.
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._session_loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def setup_scorer(cfg: RewardConfig) -> RewardScorer:
    """The scorer the config names (its plug-ins resolved, its ``env:`` values read); ConfigError if one is wrong."""
    common: dict[str, Any] = {"timeout_s": cfg.reward_timeout_s, "concurrency": cfg.reward_concurrency}
    if cfg.group_reward is not None:
        fn = resolve(cfg.group_reward, field="producer.group_reward", signature=GROUP_REWARD_SIGNATURE)
        return GroupScorer(fn, name=cfg.group_reward, **common)
    if cfg.reward_url is not None:
        return HttpScorer(expand_env(cfg.reward_url), headers={k: expand_env(v) for k, v in cfg.reward_headers.items()},
                          retries=cfg.reward_retries, backoff_s=cfg.reward_backoff_s, **common)
    return SampleScorer(resolve_reward(cfg.reward), **common)
