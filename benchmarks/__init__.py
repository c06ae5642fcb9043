"""Benchmarks and analyses of finished runs: method tables, cost and quality studies.

Nothing here is imported by the ServerApp or the ClientApp, and none of it travels in the FAB
(``fab-include`` in pyproject.toml). Run them through the ``fibos`` command (``fibos --help``).
"""
