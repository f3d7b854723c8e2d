"""A Sentinel lock store failed over (SENTINEL FAILOVER) while Celery tasks hold and wait for locks.

Three prefork workers run the chaos app's singleton tasks on a Sentinel group
(1 master, 1 replica, 3 Sentinels), with ``redlock_min_replicas`` left at
"auto" (1 here). While tasks hold their locks the Sentinels are told to fail
over: the replica is promoted, and the old master keeps taking writes for
some seconds, until the Sentinels make it a replica of the new one. Workers'
connections to the old master get no replica's acknowledgement there (its
replica left), nor on the new master until the old one replicates it, so
acquisitions are given back and requeued, renewals do not count and the
holders of the moment lose their leases (stale holders); then locking goes on
on the new master. The history is judged by the same checker as the other
scenarios. Each run fails over from whichever server is master at its start.
"""

from __future__ import annotations

import pytest

from tests.chaos import report
from tests.chaos.conftest import CeleryChaos
from tests.redis_topologies import MASTER_NAME, wait_replicas_online

# Every scenario runs REPEATS times (the ``attempt`` fixture of conftest.py).
pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.usefixtures("attempt")]

SCENARIO = "Sentinel lock store: planned failover (SENTINEL FAILOVER)"
RESOURCES = 3


def batch(calls: int, seconds: float) -> list[tuple[str, float]]:
    """``calls`` calls of ``seconds`` each, spread over the resources."""
    return [(f"res{i % RESOURCES}", seconds) for i in range(calls)]


@pytest.mark.timeout(120)
def test_planned_sentinel_failover_under_load(sentinel_chaos: CeleryChaos) -> None:
    """SENTINEL FAILOVER while tasks hold locks and more arrive: no overlap, fences rising
    across the failover, no task lost."""
    c = sentinel_chaos
    group = c.sentinel
    assert group is not None
    run = c.new_run()
    ids = c.submit("chaos.work", run, batch(9, 0.5))
    c.wait_running(run, 2)
    current = group.master_port()
    servers = [group.master, *group.replicas]
    promoted = next(server for server in servers if server.port != current)
    group.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
    group.wait_for_master(promoted)
    # Calls that arrive while the old master still takes writes.
    ids += c.submit("chaos.work", run, batch(6, 0.3))
    wait_replicas_online(promoted, 1, timeout=60)  # the old master replicates the new one
    ids += c.submit("chaos.work", run, batch(6, 0.3))
    states = c.wait_settled(ids, timeout=60)

    verdict = c.verdict(run, ids, states)
    report.record(SCENARIO, verdict, faults=1)
    assert not verdict.violations, verdict.describe()
    assert not verdict.lost, verdict.describe()
    assert {state for state, _ in states.values()} == {"SUCCESS"}, verdict.describe()
    assert "could not have the lock confirmed by its replicas" in "".join(
        worker.log() for worker in c.workers
    )
