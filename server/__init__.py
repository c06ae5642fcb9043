"""The ServerApp and its strategies: rounds, replies, evaluation, records, checkpoints.

Operator commands live in :mod:`server.commands`, benchmarks and analyses in :mod:`server.benchmarks`.
"""
