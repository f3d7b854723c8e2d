"""Lock counters: per task, shared with forked pool processes, summed on request."""

from __future__ import annotations

import os
import warnings

from celery_redlock.celery.stats import COUNTERS, OTHER_TASKS, StatsTable


def test_counts_per_task_and_unknown_tasks_share_a_row():
    """Counts land in their task's row; a task unknown at start goes to the (other) row."""
    table = StatsTable(["a", "b"], processes=2)
    table.add("a", COUNTERS.index("acquired"))
    table.add("a", COUNTERS.index("acquired"))
    table.add("b", COUNTERS.index("skipped"))
    table.add("late", COUNTERS.index("lost"))
    totals = table.totals()
    assert totals["a"]["acquired"] == 2 and totals["a"]["skipped"] == 0
    assert totals["b"]["skipped"] == 1
    assert totals[OTHER_TASKS]["lost"] == 1
    assert set(table.report()) == {"since", "pid", "processes", "tasks"}


def test_forked_children_count_into_the_parents_table():
    """A forked child's counts are visible to the parent: the memory is shared, not copied."""
    table = StatsTable(["a"], processes=2)
    table.add("a", COUNTERS.index("acquired"))
    with warnings.catch_warnings():
        # Python 3.12+ warns about forking a process with threads; the child
        # only touches the shared memory and exits.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: count, then leave without running any test teardown
        try:
            for _ in range(5):
                table.add("a", COUNTERS.index("released"))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    totals = table.totals()["a"]
    assert totals["acquired"] == 1 and totals["released"] == 5


def _count_many(table: StatsTable, times: int) -> None:
    for _ in range(times):
        table.add("a", COUNTERS.index("acquired"))


def test_pool_processes_counting_at_once_lose_nothing():
    """Two billiard pool processes (index 0 and 1) counting at the same time: every count lands.

    Each writes its own row, found after billiard names the process; sharing
    one row would lose increments to the race between read and write.
    """
    from billiard.context import ForkProcess

    table = StatsTable(["a"], processes=2)
    times = 300000
    workers = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for index in range(2):
            process = ForkProcess(target=_count_many, args=(table, times))
            process.index = index
            process.start()
            workers.append(process)
    for process in workers:
        process.join(30)
        assert process.exitcode == 0
    assert table.totals()["a"]["acquired"] == 2 * times


def test_lock_events_land_in_their_counters():
    """Each lock event the guard sends adds to its counter, but not a release of a lost lock."""
    from celery import Celery

    from celery_redlock.celery import events, stats

    app = Celery("stats-signals", set_as_current=False)

    @app.task(name="t.one", shared=False)
    def one() -> None:
        """A task to send lock events for."""

    task = app.tasks["t.one"]
    table = stats.enable(app, processes=1)
    events.send_acquired(task, "i", "k", 1, 1.0, None)
    events.send_acquired(task, "j", "k", 3, 1.0, 2.5)
    events.send_acquired(task, "k", "k", 4, 1.0, 0.5)
    for action in ("skip", "skip", "requeue", "raise"):
        events.send_contended(task, "i", "k", None, action, 0, None)
    events.send_contended(task, "j", "k", None, "requeue", 0, 7)
    events.send_lost(task, "i", "k", 1, "expired")
    events.send_released(task, "i", "k", 1, False)
    events.send_released(task, "i", "k", 2, True)
    assert table.totals()["t.one"] == {
        "acquired": 3,
        "skipped": 2,
        "requeued": 2,
        "raised": 1,
        "lost": 1,
        "released": 1,
        # Fair requeue: two calls admitted after waiting, 3 s in all, the longest
        # 2.5 s; the longest line seen was 7.
        "waited": 2,
        "wait_ms": 3000,
        "wait_max_ms": 2500,
        "line_max": 7,
    }
    waits = table.report()["tasks"]["t.one"]
    assert (waits["wait_mean_s"], waits["wait_longest_s"]) == (1.5, 2.5)
    assert stats.table_for(app) is table


def test_a_table_enabled_or_disabled_after_a_task_was_counted_is_heeded_from_the_next_event():
    """A task's cells are found once, and again when a table comes or goes."""
    import time

    from celery import Celery

    from celery_redlock.celery import events, metrics, stats

    app = Celery("stats-cache", set_as_current=False)

    @app.task(name="t.cached", shared=False)
    def cached() -> None:
        """A task to send lock events for."""

    task = app.tasks["t.cached"]

    def one_run() -> None:
        events.send_acquired(task, "i", "k", 1, 1.0, None, time.monotonic())
        events.send_released(task, "i", "k", 1, True)

    table = stats.enable(app, processes=1)
    one_run()  # its cells are known now, without a wait table
    waits = metrics.enable(app, processes=1)
    one_run()
    assert table.totals()["t.cached"]["acquired"] == 2
    histogram, held = waits.snapshot()
    assert histogram["t.cached"]["count"] == 1 and held == {"t.cached": 0}
    stats.disable(app, "turned off")
    one_run()
    assert table.totals()["t.cached"]["acquired"] == 2
    assert waits.snapshot()[0]["t.cached"]["count"] == 2
