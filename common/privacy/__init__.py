"""Differential privacy of what a node uploads: clipping, Gaussian noise and the node's privacy ledger."""
