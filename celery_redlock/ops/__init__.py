"""What operators run: the ``celery redlock`` command group, its commands and the dashboard.

The top layer: it may import every other folder of the package and Celery.
Nothing in the package imports it.
"""

from __future__ import annotations

# The commands are Celery's: without Celery, fail here with the Celery layer's
# message naming the extra to install.
import celery_redlock.celery  # noqa: F401
