"""ServerApp side: strategy, Fisher state, reply validation, evaluation and the local launcher."""
