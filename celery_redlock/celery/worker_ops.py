"""The worker's operator services: the reaper, the metrics endpoint and the counters' history.

:class:`OpsStep` is a worker bootstep that :func:`celery_redlock.install`
adds after :class:`~celery_redlock.celery.bootsteps.RedlockStep`. Its constructor
runs in the main process before the pool forks, so the shared memory of the
lock waits and held locks (:mod:`celery_redlock.celery.metrics`) reaches every pool
process; its ``start`` runs once the pool is up and starts, in the main
process, the reaper's thread (:mod:`celery_redlock.celery.reaper`), the minute
samples of the counters (:mod:`celery_redlock.celery.rates`) on the worker's timer,
and, when asked, the Prometheus endpoint (:mod:`celery_redlock.celery.prometheus`).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from celery import bootsteps

from celery_redlock.calls.options import OPTIONS
from celery_redlock.celery.settings import flag
from celery_redlock.core.exceptions import ConfigurationError
from celery_redlock.core.store import LockStore, parse_store

from . import metrics, rates, stats
from .reaper import DEFAULT_UNRESPONSIVE_AFTER, Reaper

__all__ = ["OpsSettings", "OpsStep", "read_ops_settings"]

logger = logging.getLogger(__name__)

#: Address the worker's metrics endpoint binds unless ``redlock_metrics_host`` says otherwise.
DEFAULT_METRICS_HOST = "127.0.0.1"

_seconds = OPTIONS["ttl"].validate  # the validator of every option given in seconds


@dataclass(frozen=True)
class OpsSettings:
    """The worker's operator settings, validated.

    Attributes:
        reaper: Run the reaper (``redlock_reaper``).
        reaper_interval: Seconds between its passes (``redlock_reaper_interval``).
        unresponsive_after: Seconds of silence that make a holder's worker
            count as dead (``redlock_reaper_unresponsive_after``).
        metrics_port: Port of the metrics endpoint; ``None``: no endpoint.
        metrics_host: Address it binds.
    """

    reaper: bool = True
    reaper_interval: float = 30.0
    unresponsive_after: float = DEFAULT_UNRESPONSIVE_AFTER
    metrics_port: int | None = None
    metrics_host: str = DEFAULT_METRICS_HOST


def _port(setting: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigurationError(setting, value, "must be a port number from 0 to 65535")
    return value


def read_ops_settings(conf: Mapping[str, Any], metrics_port: Any = None) -> OpsSettings:
    """Read the reaper and metrics settings; ``metrics_port`` is the worker option, if given.

    Raises:
        ConfigurationError: Naming the setting or option with a bad value, or
            a metrics port without ``prometheus_client`` installed.
    """
    defaults = OpsSettings()
    interval = conf.get("redlock_reaper_interval")
    silence = conf.get("redlock_reaper_unresponsive_after")
    host = conf.get("redlock_metrics_host") or DEFAULT_METRICS_HOST
    if not isinstance(host, str):
        raise ConfigurationError("redlock_metrics_host", host, "must be a host name or address")
    if metrics_port is not None:
        port = _port("--redlock-metrics-port", metrics_port)
    else:
        port = _port("redlock_metrics_port", conf.get("redlock_metrics_port"))
    if port is not None and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigurationError(
            "--redlock-metrics-port" if metrics_port is not None else "redlock_metrics_port",
            port,
            "needs prometheus_client: pip install 'celery-redlock[web]'",
        )
    return OpsSettings(
        reaper=flag(conf, "redlock_reaper", defaults.reaper),
        reaper_interval=(
            defaults.reaper_interval
            if interval is None
            else _seconds("redlock_reaper_interval", interval)
        ),
        unresponsive_after=(
            defaults.unresponsive_after
            if silence is None
            else _seconds("redlock_reaper_unresponsive_after", silence)
        ),
        metrics_port=port,
        metrics_host=host,
    )


class OpsStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery ships no type hints
    """Worker bootstep of the reaper, the metrics endpoint and the counters' history.

    Receives ``--redlock-metrics-port`` as ``redlock_metrics_port`` (which wins
    over the setting of that name). A configuration error stops a
    command-line worker with one line naming the setting and value.
    """

    name = "celery-redlock-ops"
    requires = ("celery_redlock.celery.bootsteps:RedlockStep", "celery.worker.components:Timer")

    def __init__(self, worker: Any, redlock_metrics_port: Any = None, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        app = worker.app
        try:
            self.settings = read_ops_settings(app.conf, redlock_metrics_port)
        except ConfigurationError as exc:
            from celery.apps.worker import Worker as CommandLineWorker

            if isinstance(worker, CommandLineWorker):
                raise SystemExit(f"celery-redlock: configuration error: {exc}") from None
            raise
        # RedlockStep (required above, so built first) turned counting on or
        # off; the waits and the history follow it.
        table = stats.table_for(app)
        self.history = rates.enable(app, table) if table is not None else None
        if table is not None:
            metrics.enable(app, table.slots - 1)
        self.reaper: Reaper | None = None
        self.server: Any = None
        self._sampling: Any = None

    def start(self, worker: Any) -> None:
        """Start the reaper, the minute samples and the metrics endpoint, as configured."""
        app, settings = worker.app, self.settings
        if self.history is not None and getattr(worker, "timer", None) is not None:
            self._sampling = worker.timer.call_repeatedly(rates.SAMPLE_SECONDS, self.history.sample)
        if settings.reaper:
            self.reaper = Reaper(
                app,
                worker.hostname,
                interval=settings.reaper_interval,
                unresponsive_after=settings.unresponsive_after,
                store=LockStore(parse_store(app.conf)),
                on_reaped=partial(metrics.count_reaped, app),
                on_pass=partial(metrics.count_reaper_pass, app),
            )
            self.reaper.start()
            logger.info(
                "celery-redlock: reaper runs every %gs (workers silent for %gs count as dead)",
                settings.reaper_interval,
                settings.unresponsive_after,
            )
        if settings.metrics_port is not None:
            from .prometheus import serve_worker_metrics

            try:
                self.server = serve_worker_metrics(
                    app, settings.metrics_host, settings.metrics_port
                )
            except OSError as exc:
                logger.error(
                    "celery-redlock: cannot serve metrics on %s:%d: %r",
                    settings.metrics_host,
                    settings.metrics_port,
                    exc,
                )

    def stop(self, worker: Any) -> None:
        """Stop what :meth:`start` started."""
        if self._sampling is not None:
            self._sampling.cancel()
            self._sampling = None
        if self.reaper is not None:
            self.reaper.stop()
            self.reaper = None
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    terminate = stop
