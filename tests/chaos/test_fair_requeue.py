"""Fair requeue under real prefork workers with random SIGKILL/SIGSTOP of pool children.

Each scenario sends calls on a few keys faster than they can run, so most are
requeued, many times; the faults kill or freeze holders. From the history:
never more than ``lock_limit`` believing holders per key, nothing lost, and
every call started within the bound docs/conflicts.md states (see
:mod:`tests.chaos.fairness`). The 150 s version, with the old behaviour
beside it, is bench/fairness_soak.py.
"""

from __future__ import annotations

import pytest

from tests.chaos.conftest import CeleryChaos
from tests.chaos.fairness import most_believing, run_soak

pytestmark = [pytest.mark.chaos, pytest.mark.integration]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("task", "limit", "calls"), [("chaos.fair1", 1, 50), ("chaos.fair3", 3, 110)]
)
def test_fair_requeue_soak(celery_chaos: CeleryChaos, task: str, limit: int, calls: int) -> None:
    """Calls waiting in line start in their turn: no more than ``limit`` at once per key,
    none lost, none overtaken by a call sent later (but for faults), and each within 2x
    the work sent before it plus its faults' recovery."""
    soak = run_soak(
        celery_chaos,
        task,
        limit,
        calls=calls,
        keys=2,
        spread=3.0,
        durations=(0.05, 0.35),
        fault_every=2.0,
        timeout=60,
    )
    assert soak.verdict is not None
    assert not soak.verdict.violations, soak.verdict.describe()
    assert not soak.verdict.lost, soak.verdict.describe()
    assert max(most_believing(soak.executions).values()) <= limit
    assert len(soak.waits) == calls
    assert soak.faults, "no fault was injected"
    # Order: a call sent a second or more after another does not start before it,
    # but for at most one call per fault (a waiter frozen or killed mid-attempt
    # loses its turn). With plain backoff (lock_fair=False) this run overtakes
    # 13-20 calls, against 1-5 faults.
    overtaken = soak.overtaken(margin=1.0)
    assert overtaken <= len(soak.faults), f"{overtaken} calls overtaken by later ones"
    over = soak.over_bound()
    assert not over, (
        f"{len(over)} waits over their bound (wait, bound): {sorted(over.values())[-5:]}; "
        f"longest wait {soak.longest:.1f} s, {soak.overtaken()} calls overtaken"
    )
