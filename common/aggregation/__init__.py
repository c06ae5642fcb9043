"""Mask-aware aggregation of client updates: holder means, published alternatives, and asynchronous steps."""
