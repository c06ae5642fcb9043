"""Local training and evaluation on a node: the one training loop, optimisers, devices."""
