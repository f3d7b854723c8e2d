"""The invoice-sync service's tasks, each a ``SingletonTask`` with a different conflict policy.

- ``sync_invoices``: pulling an account's invoices twice at once is wasted
  work, so a duplicate is skipped (the default policy).
- ``rebuild_report``: every request must be honoured, but two rebuilds of one
  report must not interleave, so a duplicate is requeued until the lock frees.
- ``charge_card``: one charge per account at a time, none dropped (requeue),
  and the ledger write carries the lock's fence so a stale holder is refused.

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
from typing import Any

from celery import Task

from celery_redlock import SingletonTask, current_lock
from celery_redlock.signals import lock_contended

from . import journal, ledger
from .celery_app import PREFIX, app, demo_redis

SYNC_SECONDS = 1.0
REBUILD_SECONDS = 0.3
GATEWAY_SECONDS = 0.1
EXPORT_SECONDS = 0.2
REMINDER_SECONDS = 0.8


@contextmanager
def _recorded(task: Task, *args: Any) -> Iterator[dict[str, Any]]:
    lease = current_lock()
    if lease is None:  # a SingletonTask run by a worker always holds its lock
        raise RuntimeError(f"{task.name} is running without its lock")
    with journal.recorded_run(
        demo_redis(),
        PREFIX,
        task=task.name.rsplit(".", 1)[-1],
        task_id=task.request.id,
        args=list(args),
        lease=lease,
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
