"""The Celery app of the operator-tooling benchmark (``bench/ops_bench.py``).

Configured from the environment:

``BENCH_OPS_BROKER``
    Redis URL of the private broker, also the result backend.
``BENCH_OPS_LOCK_URL``
    Redis URL of the private lock store.
``BENCH_OPS_MODE``
    ``full``: what celery-redlock does by default, lock values with their
    metadata (format ``v2``) and the per-task counters on.
    ``bare``: the same worker without either: ``redlock_stats = False``, and
    lock values in the previous ``v1`` format (token, task id, node, pid),
    written by a stand-in for ``Holder.new``/``encode`` as they were before
    the metadata, so the difference between the arms is exactly what the
    metadata and the counters cost.

Both arms install celery-redlock (the worker bootstep) and run
``bench.redlock``, a ``SingletonTask`` returning its argument.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

from celery import Celery

from celery_redlock import SingletonTask, install
from celery_redlock.core.holder import Holder

__all__ = ["app", "redlock"]

BROKER_URL = os.environ.get("BENCH_OPS_BROKER", "redis://127.0.0.1:1/0")
LOCK_URL = os.environ.get("BENCH_OPS_LOCK_URL", "redis://127.0.0.1:1/0")
MODE = os.environ.get("BENCH_OPS_MODE", "full")
if MODE not in ("full", "bare"):
    raise SystemExit(f"BENCH_OPS_MODE must be full or bare, not {MODE!r}")

app = Celery("ops_bench", set_as_current=True)
app.conf.update(
    broker_url=BROKER_URL,
    result_backend=BROKER_URL,
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    redlock_url=LOCK_URL,
    redlock_stats=MODE == "full",
)
install(app)


def _new_v1(
    cls: type[Holder],
    task_id: str,
    hostname: str | None = None,
    *,
    ttl: float | None = None,
    queue: str | None = None,
) -> Holder:
    return cls(
        task_id=task_id,
        hostname=hostname or socket.gethostname(),
        pid=os.getpid(),
        token=secrets.token_hex(16),
    )


def _encode_v1(self: Holder) -> str:
    fields = ("v1", self.token, self.task_id, self.hostname, str(self.pid))
    return "|".join(field.replace("|", "_") for field in fields)


if MODE == "bare":
    new: Any = classmethod(_new_v1)
    Holder.new = new  # type: ignore[method-assign]
    Holder.encode = _encode_v1  # type: ignore[method-assign]


@app.task(name="bench.redlock", base=SingletonTask)  # type: ignore[untyped-decorator]
def redlock(i: int) -> int:
    """Return ``i`` under celery-redlock's lock."""
    return i
