"""The worker class of the RQ tests' ``rq worker`` subprocesses (``--worker-class``)."""

from __future__ import annotations

from rq import Worker


class PromptStopWorker(Worker):
    """RQ's Worker, whose warm shutdown never waits out a 60-second pubsub poll.

    At teardown RQ sends UNSUBSCRIBE, then stops its pubsub thread, which
    polls with a 60 s timeout; redis-py >= 8.2's ``stop()`` joins the thread.
    When the UNSUBSCRIBE reply wakes the thread before the stop, it polls
    again and the shutdown waits up to a minute (the tests' harness gives up
    and kills the worker after 20 s). Stopping the thread first lets that reply
    end its last poll.
    """

    def unsubscribe(self) -> None:
        """Trip the pubsub thread's flag, then unsubscribe as RQ does."""
        thread = self.pubsub_thread
        if thread is not None:
            try:
                thread.stop(timeout=0)
            except TypeError:  # redis-py < 8.2: stop() only trips the flag
                thread.stop()
        super().unsubscribe()
