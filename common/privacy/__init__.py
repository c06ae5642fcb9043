"""Differential privacy of what a node uploads: DP-SGD steps, the noised Fisher, and the node's
accountant."""
