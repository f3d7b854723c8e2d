"""A process that takes Redlock locks over N masters and records every hold.

``python -m tests.chaos.redlock_driver '<json>'`` runs until the run's stop key
is set. Each piece of work is pushed to the run's ``submitted`` list before it
starts and ends with one outcome: ``SUCCESS`` (it held the lock, wrote to the
fenced store, and released or found the lock lost) or ``FAILURE`` with the
reason it could not get the lock. Configuration (JSON object):

``masters``    list of ``redis://`` URLs of the Redlock masters
``history``    URL of the Redis holding histories and the fenced store
``run``        the run's key prefix
``name``       this driver's name, prefix of its work ids
``resources``  lock names to cycle through
``ttl``        lock TTL in seconds
``hold``       seconds to hold each lock
``wait``       longest wait for one lock, in seconds
"""

from __future__ import annotations

import json
import sys
from typing import Any

import redis

from celery_redlock import LockError, Redlock, RedlockError
from tests.chaos.history import (
    FencedStore,
    hold,
    record_outcome,
    stop_key,
    submitted_key,
    watched_execution,
)


def work_once(config: dict[str, Any], client: redis.Redis, work_id: str, resource: str) -> None:
    """Take one lock, hold it, release it; record the execution and the outcome."""
    run = config["run"]
    lock = Redlock(
        config["masters"],
        f"{run}:lock:{resource}",
        timeout=config["ttl"],
        blocking=True,
        blocking_timeout=config["wait"],
        thread_local=False,
        auto_renew=True,
        label=work_id,
    )
    try:
        acquired = lock.acquire()
    except (RedlockError, redis.RedisError) as exc:
        record_outcome(client, run, work_id, "FAILURE", f"acquire failed: {exc!r}")
        return
    if not acquired:
        record_outcome(client, run, work_id, "FAILURE", f"no majority within {config['wait']}s")
        return
    lease = lock.lease
    with watched_execution(client, run, work_id, lease) as recorder:
        hold(recorder, FencedStore(client, run), config["hold"])
    note = "released"
    try:
        lock.release()
    except LockError as exc:
        note = f"release: {exc!r}"
    record_outcome(client, run, work_id, "SUCCESS", note)


def main(argv: list[str]) -> int:
    """Run the driver described by ``argv[1]`` until its run is told to stop."""
    config = json.loads(argv[1])
    client = redis.Redis.from_url(config["history"])
    run, resources = config["run"], config["resources"]
    count = 0
    while not client.exists(stop_key(run)):
        work_id = f"{config['name']}-{count}"
        client.rpush(submitted_key(run), work_id)
        work_once(config, client, work_id, resources[count % len(resources)])
        count += 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
