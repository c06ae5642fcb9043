"""The ServerApp and its strategies: rounds, replies, evaluation, records, checkpoints.

Everything here is what the ServerApp imports and travels in the FAB; operator commands live in
:mod:`cli`, benchmarks and analyses in :mod:`benchmarks`.
"""
