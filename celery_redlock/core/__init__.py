"""The lock core: token-valued Redis locks, Redlock, renewal, fences and the lock store.

Everything here serves any Python program. It may import redis-py and the
standard library, never Celery, RQ or another folder of this package.
"""
