"""Operator and developer tools that are not part of the Flower app: benchmarks, analyses, docs generators.

Nothing here is imported by the ServerApp or the ClientApp, and none of it travels in the FAB
(``fab-include`` in pyproject.toml). Run them through the ``fibos`` command (``fibos --help``).
"""
