"""The invoice-sync service's tasks, each locked in the way its job calls for.

Three ``SingletonTask``s lock while they run (``lock_mode="while_executing"``,
the default), each with a different conflict policy:

- ``sync_invoices``: pulling an account's invoices twice at once is wasted
  work, so a duplicate is skipped (the default policy).
- ``rebuild_report``: every request must be honoured, but two rebuilds of one
  report must not interleave, so a duplicate is requeued until the lock frees.
- ``charge_card``: one charge per account at a time, none dropped (requeue),
  and the ledger write carries the lock's fence so a stale holder is refused.

Three more take their lock when they are sent, so duplicates never reach the
queue (the lock windows of docs/modes.md):

- ``nightly_report`` (``until_executed``): the report of a day is generated
  once; every "generate" click from the moment it is queued until it is
  done gets the task id of that one run (``lock_on_duplicate="return_existing"``).
- ``refresh_rates`` (``until_executing``, ``lock_on_duplicate="raise"``):
  requests within the debounce delay (a countdown) fold into the one queued
  refresh, and the caller learns so from ``DuplicateTask``; once the refresh
  has started, rates may have moved, so the next request queues again.
- ``sync_catalog`` (``until_and_while_executing``): a storm of webhooks leaves
  at most one sync running and one queued behind it; the queued one waits its
  turn (requeue) and then picks up every change the storm announced.

Two plain tasks (no ``SingletonTask``) are locked by the queue they come from:

- ``export_statement`` is routed to the exports queue, which the app's
  ``redlock_queues`` setting locks with requeue: every export is written, one
  at a time.
- ``send_reminder`` is routed to the reminders queue, which the worker locks
  with ``--redlock-queues``: a reminder requested while one is being sent is
  skipped (one e-mail, not ten).

Every run is recorded in Redis (see :mod:`example_project.journal`) for the driver.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from celery import Task

from celery_redlock import SingletonTask, current_lock
from celery_redlock.celery.signals import lock_contended

from . import journal, ledger
from .celery_app import PREFIX, app, demo_redis

SYNC_SECONDS = 1.0
REBUILD_SECONDS = 0.3
GATEWAY_SECONDS = 0.1
EXPORT_SECONDS = 0.2
REMINDER_SECONDS = 0.8
REPORT_SECONDS = 0.6
RATES_SECONDS = 0.8
CATALOG_SECONDS = 1.0


@contextmanager
def _recorded(task: Task, *args: Any, locked: bool = True) -> Iterator[dict[str, Any]]:
    """Record the run; ``locked=False`` for a task that runs without a lock (until_executing)."""
    lease = current_lock()
    if locked and lease is None:  # a task a worker runs under a lock must hold it
        raise RuntimeError(f"{task.name} is running without its lock")
    key = lease.name if lease is not None else cast(SingletonTask, task).lock_key_for(*args)
    with journal.recorded_run(
        demo_redis(),
        PREFIX,
        task=task.name.rsplit(".", 1)[-1],
        task_id=task.request.id,
        args=list(args),
        key=key,
        fence=lease.fence if lease is not None else None,
    ) as outcome:
        yield outcome


@app.task(base=SingletonTask, bind=True)
def sync_invoices(self: Task, account_id: int) -> int:
    """Pull the account's invoices from the billing provider; duplicates are skipped."""
    with _recorded(self, account_id) as outcome:
        time.sleep(SYNC_SECONDS)  # stands in for the provider's API
        outcome["invoices"] = 3
    return 3


@app.task(
    base=SingletonTask,
    bind=True,
    lock_on_conflict="requeue",
    lock_requeue_delay=0.1,
    lock_requeue_max_delay=0.4,
    lock_requeue_jitter=0.5,
    lock_max_requeues=50,
)
def rebuild_report(self: Task, account_id: int) -> str:
    """Rebuild the account's monthly report; duplicates wait their turn."""
    with _recorded(self, account_id):
        time.sleep(REBUILD_SECONDS)
    return f"report-{account_id}.pdf"


@app.task(
    base=SingletonTask,
    bind=True,
    lock_key=["account_id"],  # one charge per account at a time, whatever the amount
    lock_on_conflict="requeue",
    lock_requeue_delay=0.1,
    lock_requeue_max_delay=0.4,
    lock_max_requeues=50,
)
def charge_card(self: Task, account_id: int, amount: int) -> dict[str, Any]:
    """Charge the card, then book the charge in the ledger under the lock's fence."""
    lease = current_lock()
    assert lease is not None
    with _recorded(self, account_id, amount) as outcome:
        time.sleep(GATEWAY_SECONDS)  # the payment gateway
        # Checking lease.lost here would narrow the window but not close it: the
        # process can pause right after the check. The fence closes it, because
        # the ledger itself refuses a write older than one it has accepted.
        result = ledger.record_charge(
            demo_redis(), PREFIX, account_id, amount, fence=lease.fence, writer=self.request.id
        )
        outcome.update(accepted=result.accepted, balance=result.balance)
    return {"accepted": result.accepted, "fence": lease.fence, "balance": result.balance}


@app.task(base=SingletonTask, bind=True, lock_mode="until_executed")
def nightly_report(self: Task, day: str) -> str:
    """Generate the day's report; while one is queued or running, a click returns its id."""
    with _recorded(self, day):
        time.sleep(REPORT_SECONDS)
    return f"nightly-{day}.pdf"


@app.task(base=SingletonTask, bind=True, lock_mode="until_executing", lock_on_duplicate="raise")
def refresh_rates(self: Task, currency: str) -> str:
    """Refresh the exchange rates; a request while one is queued raises ``DuplicateTask``."""
    # until_executing holds no lock while the task runs: a request made after
    # this refresh started queues the next one, which may overlap this one.
    with _recorded(self, currency, locked=False):
        time.sleep(RATES_SECONDS)  # the rates provider
    return currency


@app.task(
    base=SingletonTask,
    bind=True,
    lock_mode="until_and_while_executing",
    lock_on_conflict="requeue",
    lock_requeue_delay=0.1,
    lock_requeue_max_delay=0.4,
    lock_max_requeues=50,
)
def sync_catalog(self: Task, shop_id: int) -> int:
    """Pull the shop's catalogue: at most one sync running and one queued behind it."""
    with _recorded(self, shop_id):
        time.sleep(CATALOG_SECONDS)  # the shop's API
    return shop_id


@app.task(bind=True)
def export_statement(self: Task, account_id: int) -> str:
    """Write the account's statement file; locked by the exports queue's configuration."""
    with _recorded(self, account_id):
        time.sleep(EXPORT_SECONDS)
    return f"statement-{account_id}.csv"


@app.task(bind=True)
def send_reminder(self: Task, account_id: int) -> bool:
    """E-mail a payment reminder; locked by the worker's ``--redlock-queues``."""
    with _recorded(self, account_id):
        time.sleep(REMINDER_SECONDS)  # the mail provider
    return True


@lock_contended.connect
def _record_contention(sender: Task, task_id: str, key: str, action: str, attempt: int, **_: Any):
    journal.record_event(
        demo_redis(),
        PREFIX,
        task=sender.name.rsplit(".", 1)[-1],
        task_id=task_id,
        key=key,
        action=action,
        attempt=attempt,
    )
