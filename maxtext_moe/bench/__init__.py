"""Benchmarks that print a table, each row a ratio to a baseline measured in the same run."""
