"""Benchmarks, not tests: one module per ``kvwarm bench`` subcommand (``benchmarks.cli``
is the command group), each printing ratios against a baseline run in the same process.
May import any kvwarm package; no product package imports this one."""
