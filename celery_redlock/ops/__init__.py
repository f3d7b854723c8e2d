"""Operator tooling of celery-redlock: what runs beside the workers, not on a task's path."""
