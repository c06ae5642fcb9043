"""The server side: the ServerApp and its strategy (this package).

Operator commands live in :mod:`server.commands`, benchmarks and analyses in :mod:`server.benchmarks`.
"""
