"""Executors over real cache layers (LMCache), behind the ``Executor`` protocol."""
