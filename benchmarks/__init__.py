"""Benchmarks run by hand or by tox, outside the package and outside pytest's reach."""
