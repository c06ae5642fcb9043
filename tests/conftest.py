"""Shared fixtures: Flower's telemetry off, caches inside the test's temp folder, the tiny text
model.

Also the order of the suite: modules marked ``federation`` (multi-process federations, minutes each)
are collected first, so that ``make test``'s workers (pytest-xdist, one module per unit) start
the longest units first and finish together instead of one worker running a five-minute federation
alone at the end.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

# Hypothesis fails an example that takes more than 200 ms of wall time, a timing assertion that
# load decides: under a loaded `make test` an example of the fleet-time model that takes 0.05 ms
# took 476 ms and failed the run. Tests here check results; speed is measured by the benchmarks.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Federation modules first, each module's tests kept together and in their own order."""
    items.sort(key=lambda item: item.get_closest_marker("federation") is None)


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    """``(model-path, data-path)`` of the tiny BERT (hidden 16, 2 layers) and the generated news
    set."""
    from tests.tiny_text import news_dataset, tiny_bert

    root = tmp_path_factory.mktemp("text")
    return str(tiny_bert(root / "bert")), str(news_dataset(root / "news"))


@pytest.fixture
def no_process(monkeypatch):
    """Fail the test if the launcher (or a subcommand through it) starts any process."""
    from cli import launcher

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(launcher.subprocess, "Popen", refuse)
    monkeypatch.setattr(launcher.subprocess, "run", refuse)
