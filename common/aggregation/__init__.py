"""Mask-aware aggregation: holder means, published alternatives, asynchronous steps."""
