"""The ClientApp and what only a node does in a run: local data, capacity probe, replies.

Everything here travels in the FAB; the node's operator commands (joining, the pre-flight and GPU
checks) live in :mod:`cli`.
"""
