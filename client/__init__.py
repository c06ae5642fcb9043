"""The ClientApp and what only a node does: local data, capacity probe, peak memory, joining."""
