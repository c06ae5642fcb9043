"""Benchmarks of how submodels are ranked: masks against the exact Fisher's, rules on finished
models, refreshes."""
