"""What a guarded call does when its lock is refused or its store fails, for every integration.

The rules live here once: a call meeting its own earlier delivery waits, a
requeue that cannot happen becomes a failure, requeues run out after
``max_requeues``, and delays back off exponentially with jitter. Each
integration carries the decision out in its own terms (Celery's ``Ignore``
and republish, RQ's ``Retry``, a plain function's return value). Nothing here
imports a framework.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError, ResponseError

from celery_redlock.core.error_text import describe_error
from celery_redlock.core.exceptions import (
    ConfigurationError,
    LockNotAcquired,
    RateLimited,
    ReplicationError,
)
from celery_redlock.core.holder import Refusal
from celery_redlock.core.keys import KeyBuilder
from celery_redlock.core.rate import Rate, RateVerdict

from .options import LockOptions

__all__ = [
    "Decision",
    "decide",
    "fair_countdown",
    "gave_up",
    "log_rate_limited",
    "log_store_failure",
    "not_acquired",
    "rate_action",
    "rate_countdown",
    "rate_keys",
    "rate_limited",
    "rate_wait",
    "requeue_countdown",
    "requeue_delay",
    "requeues_charged",
]

logger = logging.getLogger(__name__)

SKIP = "skip"
REQUEUE = "requeue"
RAISE = "raise"


@dataclass(frozen=True)
class Decision:
    """The outcome of a refused acquire.

    Attributes:
        action: ``"skip"``, ``"requeue"`` or ``"raise"``.
        own: The key is held by an earlier delivery of this very call: it must
            wait for it (never skip, never give up), or it would be lost or run twice.
        gave_up: The call was to be requeued but has used up ``max_requeues``;
            ``action`` is then ``"raise"``.
    """

    action: str
    own: bool = False
    gave_up: bool = False


def decide(
    refusal: Refusal,
    call_id: str | None,
    on_conflict: str,
    *,
    requeues: int = 0,
    max_requeues: int = 0,
    can_requeue: bool = True,
) -> Decision:
    """Decide what a call does after its acquire was refused.

    Args:
        refusal: Who held the key.
        call_id: The id of the refused call (a task or job id), if it has one.
        on_conflict: The call's policy: ``"skip"``, ``"requeue"`` or ``"raise"``
            (a ``"wait"`` that ran out is a ``"raise"``).
        requeues: How often this call was requeued so far.
        max_requeues: How often it may be.
        can_requeue: Whether this call can be requeued at all (an eager Celery
            call or a job run outside a worker cannot).
    """
    if call_id is not None and refusal.holder_id == call_id:
        return Decision(REQUEUE, own=True)
    action = on_conflict if on_conflict in (SKIP, REQUEUE) else RAISE
    if action == REQUEUE and not can_requeue:
        action = RAISE
    if action == REQUEUE and requeues >= max_requeues:
        return Decision(RAISE, gave_up=True)
    return Decision(action)


def not_acquired(
    what: str, key: str, refusal: Refusal, kind: str, why: str = ""
) -> LockNotAcquired:
    """The error of a call not run because ``refusal``'s holder held ``key``.

    Args:
        what: The call, as log lines name it (``task add[1f3c]``).
        key: The lock key.
        refusal: Who held it.
        kind: What holders are called in the message (``task``, ``job``, ``call``).
        why: Appended to the message (e.g. `` within wait_timeout``).
    """
    return LockNotAcquired(
        f"{what} not run: {refusal.describe(kind)} holds {key}{why}",
        lock_name=key,
        holder=refusal.holder_id,
        holder_ttl=refusal.ttl,
    )


def gave_up(
    what: str,
    key: str,
    max_requeues: int,
    refusal: Refusal,
    unreachable: RedisError | None = None,
) -> LockNotAcquired:
    """The error of a call that used up its requeues (to a holder, or to an unreachable store).

    A call waiting in line is charged by its wait (:func:`requeues_charged`):
    the message then says how long it waited.
    """
    why = (
        f"the lock store kept failing for {key} ({describe_error(unreachable)})"
        if unreachable is not None
        else f"lock {key} stayed held by {refusal.holder_id or 'another holder'}"
    )
    spent = f"{max_requeues} requeues"
    if refusal.rank is not None and refusal.arrival_us is not None and refusal.now_ms:
        waited = refusal.now_ms / 1000 - refusal.arrival_us / 1_000_000
        spent += f" (waited {waited:.1f} s in line, what the backoff of {spent} takes)"
    error = LockNotAcquired(
        f"{what} gave up after {spent}: {why}",
        lock_name=key,
        holder=refusal.holder_id,
        holder_ttl=refusal.ttl,
    )
    error.__cause__ = unreachable
    return error


def requeue_delay(options: LockOptions, attempt: int, draw: float) -> float:
    """Return the countdown of requeue number ``attempt`` (1-based).

    Exponential from ``requeue_delay``, capped at ``requeue_max_delay``; up to
    ``requeue_jitter`` of it is taken off at random (``draw`` in [0, 1)) so that
    duplicates that collided once do not collide again.
    """
    # The exponent is capped: 2**40 times any delay is past every sane cap.
    delay = min(options.requeue_max_delay, options.requeue_delay * 2 ** min(attempt - 1, 40))
    return float(delay * (1 - options.requeue_jitter * draw))


def requeue_countdown(
    options: LockOptions, attempt: int, draw: float, decision: Decision, refusal: Refusal
) -> float:
    """The delay of a requeue: the backoff, and no longer than an own holder's lock can last.

    A call waiting for its own earlier delivery comes back once that delivery's
    lock has expired, should the delivery have died.
    """
    delay = requeue_delay(options, attempt, draw)
    if decision.own and refusal.ttl is not None:
        delay = min(delay, refusal.ttl + 0.1)
    return delay


#: Longest poll of a call that is next in line, in seconds.
NEXT_POLL = 0.25


def fair_countdown(
    options: LockOptions,
    attempt: int,
    draw: float,
    refusal: Refusal,
    seen: tuple[int, int] | None = None,
) -> float:
    """The delay of a requeue that keeps its place in line (``refusal.rank`` is set).

    A call that is next in line (within the first ``limit`` waiters) comes back
    after a short poll (a quarter of ``requeue_delay``, at most
    :data:`NEXT_POLL`, and no later than the holder's lease could end). One
    further back comes back when about half of the turns ahead of it should
    have passed, judged by how fast its rank moved since its previous attempt
    (``seen``: that rank and the server's milliseconds then); without that
    measure it backs off as usual, but at most ``requeue_delay`` per turn
    ahead, so it is never asleep for long when its turn comes.
    """
    assert refusal.rank is not None
    poll = min(NEXT_POLL, options.requeue_delay / 4)
    if refusal.ttl is not None:
        poll = min(poll, refusal.ttl + 0.05)
    turns = refusal.rank - (refusal.limit or 1) + 1
    if turns <= 0:
        return poll
    now_ms = refusal.now_ms
    if seen is not None and now_ms is not None and seen[0] > refusal.rank and now_ms > seen[1]:
        per_turn = (now_ms - seen[1]) / 1000 / (seen[0] - refusal.rank)
        delay = turns * per_turn / 2
    else:
        delay = min(requeue_delay(options, attempt, draw), turns * options.requeue_delay)
    return max(poll, min(delay, options.requeue_max_delay))


def requeues_charged(options: LockOptions, requeues: int, refusal: Refusal) -> int:
    """How many requeues a refused call is charged against ``max_requeues``.

    A call waiting in line (``refusal.rank`` set) polls much more often than
    the backoff would requeue it (the next waiter every quarter second), so it
    is charged by how long it has waited since it joined the line: as many
    requeues as the plain backoff, without jitter, would have made in that
    time. It gives up no sooner than it would have without the line. Any
    other call is charged its ``requeues`` so far.
    """
    if refusal.rank is None or refusal.arrival_us is None or refusal.now_ms is None:
        return requeues
    waited = refusal.now_ms / 1000 - refusal.arrival_us / 1_000_000
    charged, spent = 0, 0.0
    while charged < options.max_requeues:
        delay = requeue_delay(options, charged + 1, 0.0)
        if delay >= options.requeue_max_delay or charged > 40:
            # From here on every countdown is the same: the rest in one step.
            charged += max(0, int((waited - spent) // delay))
            break
        if spent + delay > waited:
            break
        spent += delay
        charged += 1
    return min(charged, options.max_requeues)


def log_store_failure(
    what: str, key: str, exc: RedisError, action: str, log: logging.Logger = logger
) -> str:
    """Log (WARNING, on the integration's ``log``) that the lock store failed for ``key``.

    Returns how it failed, for error messages.

    A server that answered with an error (ACL, wrong type, out of memory) was
    reached: that needs a different fix than an outage, so the line says which.
    So does a lock its replicas did not confirm (``min_replicas``): the server
    answered, but the topology is changing under it.
    """
    failure = "refused the lock command" if isinstance(exc, ResponseError) else "unreachable"
    if isinstance(exc, ReplicationError):
        failure = "could not have the lock confirmed by its replicas"
    log.warning(
        "%s: lock store %s for %s (%s); %s",
        what,
        failure,
        key,
        describe_error(exc),
        "running WITHOUT the lock" if action == "run" else action,
    )
    return failure


def rate_keys(
    name: str,
    run: Callable[..., Any],
    options: LockOptions,
    option: str = "lock_rate_key",
    key_option: str = "lock_key",
) -> KeyBuilder | None:
    """The builder of a call's rate keys, or ``None`` without a rate limit.

    Rate keys are ``<prefix>:rate:v1:{<name>:<digest>}``: of ``rate_key``'s
    arguments, else of the lock key's, so by default one rate key per lock key.
    ``option`` and ``key_option`` are how errors name ``rate_key`` and ``key``
    (``rate_key`` and ``key`` for the decorator and RQ).

    Raises:
        ConfigurationError: If ``rate_key`` (or ``key``) names an argument ``run``
            does not take; for the decorator and RQ (``option`` ``"rate_key"``,
            which have no other source of a rate), if ``rate_key`` comes without a rate.
    """
    if options.rate is None:
        if options.rate_key is not None and option == "rate_key":
            raise ConfigurationError(option, options.rate_key, "needs a rate (rate=...)")
        return None
    prefix = f"{options.key_prefix}:rate"
    if options.rate_key is None:
        return KeyBuilder(name, run, options.key, prefix, option=key_option)
    return KeyBuilder(name, run, options.rate_key, prefix, option=option)


def rate_action(on_conflict: str, can_requeue: bool = True) -> str:
    """What a call over its rate limit does: ``"skip"``, ``"requeue"``, ``"wait"`` or ``"raise"``.

    The same ``on_conflict`` as for a held lock. A call that cannot be
    requeued (an eager Celery call, a job run outside a worker) raises instead;
    rate requeues never count against ``max_requeues`` (the wait is exact, and
    a slot frees in it).
    """
    if on_conflict == REQUEUE and not can_requeue:
        return RAISE
    return on_conflict if on_conflict in (SKIP, REQUEUE, "wait") else RAISE


def rate_wait(verdict: RateVerdict, waited: float, timeout: float | None) -> float | None:
    """How long a waiting call sleeps before asking again: exactly until a slot frees.

    ``None`` when that would take it past ``timeout`` seconds of waiting in
    all (``None``: no limit): the call is then refused at once rather than
    after a sleep that cannot end in time.
    """
    if timeout is not None and waited + verdict.wait > timeout:
        return None
    return verdict.wait


def rate_countdown(options: LockOptions, verdict: RateVerdict, draw: float) -> float:
    """When a call over its rate limit comes back: when a slot frees, plus jitter.

    The jitter (up to ``requeue_jitter`` of the window, ``draw`` in [0, 1))
    spreads the calls refused together over the window, so they do not all
    return at the instant one slot frees.
    """
    assert options.rate is not None
    return verdict.wait + 0.001 + draw * options.requeue_jitter * options.rate.window


def rate_limited(what: str, key: str, rate: Rate, verdict: RateVerdict) -> RateLimited:
    """The error of a call not run because rate key ``key`` had no free slot."""
    why = "is backed off" if verdict.backed_off else f"used {verdict.used}/{verdict.limit}"
    return RateLimited(
        f"{what} not run: rate {rate} of {key} {why}; a slot frees in {verdict.wait:.3f}s",
        lock_name=key,
        retry_after=verdict.wait,
    )


def log_rate_limited(
    call: Any, rate: Rate, verdict: RateVerdict, action: str, log: logging.Logger = logger
) -> None:
    """Log (INFO) that ``call`` (a guarded ``Call``) found its rate key used up, and its action."""
    log.info(
        "%s: rate %s of %s is used up (%d/%d%s); %s",
        call.label,
        rate,
        call.rate_key,
        verdict.used,
        verdict.limit,
        ", backed off" if verdict.backed_off else "",
        action,
    )
