"""Lock counters: per task, shared with forked pool processes, summed on request."""

from __future__ import annotations

import os
import warnings

from celery_redlock.stats import COUNTERS, OTHER_TASKS, StatsTable


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
