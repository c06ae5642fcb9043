"""What both strategies are built from: the nodes, the per-node messages and evaluations, the round
records.

The synchronous strategy (:mod:`server.strategy`) and the asynchronous one
(:mod:`server.async_strategy`) share the node registry (:mod:`~server.strategy_core.node_registry`),
the per-node submodel Messages and the evaluations (:mod:`~server.strategy_core.base`), and the
records each round leaves (:mod:`~server.strategy_core.round_records`).
"""
