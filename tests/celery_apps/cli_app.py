"""A small app for the command-line tests: one SingletonTask, configured from the environment.

``REDLOCK_TEST_BROKER``
    Broker URL (default ``memory://``: the commands under test need none).
``REDLOCK_TEST_LOCK_URL``
    ``redlock_url``.
``REDLOCK_TEST_PREFIX``
    ``redlock_key_prefix``.
``REDLOCK_TEST_SETTINGS``
    JSON object of further settings, applied last (a bad one on purpose).

``celery -A tests.celery_apps.cli_app ...`` builds the app at import.
"""

from __future__ import annotations

import json
import os

from celery import Celery

from celery_redlock import SingletonTask

#: The task's name, as lock keys and ``--task`` name it.
TASK_NAME = "cli.sync"

app = Celery("cli-app", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("REDLOCK_TEST_BROKER", "memory://"),
    redlock_url=os.environ["REDLOCK_TEST_LOCK_URL"],
    redlock_key_prefix=os.environ["REDLOCK_TEST_PREFIX"],
    worker_hijack_root_logger=False,
)
app.conf.update(json.loads(os.environ.get("REDLOCK_TEST_SETTINGS") or "{}"))


@app.task(base=SingletonTask, name=TASK_NAME)
def sync(account: int) -> int:
    """Stands for any singleton task; the tests never run it."""
    return account
