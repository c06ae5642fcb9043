"""The names the run config accepts for local training, free of torch: checking a configuration
never loads it."""

from __future__ import annotations

#: Allowed values of ``optimizer``.
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")

#: Allowed values of node-config ``device``: ``auto`` picks cuda, then mps, then cpu.
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda", "mps")
