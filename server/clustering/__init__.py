"""Clustered aggregation: one model per cluster of nodes (the `cluster-by` key), each trained by
its own copy of the run's method."""
