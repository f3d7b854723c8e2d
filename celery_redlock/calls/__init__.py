"""The guarded call, free of any framework: lock options, conflict policies and the current lock.

Every integration (Celery tasks, RQ jobs, plain functions, coroutines) runs
its calls through this layer. It may import :mod:`celery_redlock.core`, never
Celery, RQ or an integration.
"""
