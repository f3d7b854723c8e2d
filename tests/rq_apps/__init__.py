"""Job functions that the RQ tests' ``rq worker`` subprocesses import."""
