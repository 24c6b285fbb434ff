"""Benchmarks: run by hand as modules (``python -m tests.bench.<name>``), never by pytest.

They measure against DESIGN.md section 11 (the performance budget) and print a table; they
assert nothing, so a noisy machine cannot fail a build.
"""
