"""Celery apps that the worker tests run in real ``celery worker`` processes."""
