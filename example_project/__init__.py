"""An invoice-sync service that uses celery-redlock, and a driver that demonstrates it.

See ``example_project/README.md``; run it with ``scripts/demo``.
"""
