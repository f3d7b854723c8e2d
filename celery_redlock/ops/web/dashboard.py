"""What the dashboard's views share: the Celery app, its lock store, and how the dashboard runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flask import current_app

from celery_redlock.core.recovery import lock_prefixes
from celery_redlock.core.store import LockStore, store_for

from .security import Auth, mode_line

__all__ = ["Dashboard", "dashboard"]


@dataclass
class Dashboard:
    """What the views share: the Celery app, the lock store, and how the dashboard runs.

    Attributes:
        app: The Celery app whose locks are shown.
        read_only: No action is offered, and POSTs are refused.
        auth: The authentication every request needs, if any.
        refresh: Seconds between automatic reloads of the lists (0: none).
        page_size: Locks per page.
        ping_timeout: Seconds to wait for workers' replies.
        hosts: Host names requests may name (empty: any).
    """

    app: Any
    read_only: bool = False
    auth: Auth | None = None
    refresh: float = 5.0
    page_size: int = 50
    ping_timeout: float = 1.0
    hosts: frozenset[str] = field(default_factory=frozenset)

    @property
    def store(self) -> LockStore:
        """The app's lock store."""
        return store_for(self.app)

    def nodes(self) -> list[Any]:
        """One plain client per node that holds locks.

        Raises:
            redis.exceptions.RedisError: When the topology cannot be discovered.
        """
        return self.store.masters()

    def prefixes(self) -> list[str]:
        """Every key prefix the app's locks use."""
        return lock_prefixes(self.app)

    @property
    def mode(self) -> str:
        """The sentence each page shows about what it may do and who may see it."""
        return mode_line(self.read_only, self.auth)


def dashboard() -> Dashboard:
    """The dashboard serving the current request."""
    state: Dashboard = current_app.extensions["celery_redlock"]
    return state
