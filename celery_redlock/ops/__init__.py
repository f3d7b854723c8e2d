"""What operators run: the ``celery redlock`` command group and its commands.

The top layer: it may import every other folder of the package and Celery.
Nothing in the package imports it.
"""
