"""A watchdog driven by hand: a clock that moves only when told to, and no thread of its own."""

from __future__ import annotations


class ManualClock:
    """A monotonic clock that moves only when told to (set :attr:`now`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NeverStarted:
    """Stands for the watchdog's thread, so its passes run only when a test calls them."""

    def is_alive(self) -> bool:
        return True
