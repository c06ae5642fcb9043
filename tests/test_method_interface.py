"""A method defined entirely in this file runs a federation; method names are compared only in the
methods package."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord
from numpy.typing import NDArray

from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.client_seed import client_seed
from common.fisher.selection import budget
from common.methods import create_method, register, registry, unregister
from common.methods.masked import MaskedMethod
from common.wire import protocol as P
from tests.inprocess_grid import inprocess_federation

ROOT = Path(__file__).resolve().parents[1]


class RandomTopK(MaskedMethod):
    """Each client holds ``ceil(gamma d)`` positions drawn at random, anew every round."""

    name = "random-topk"
    summary = "a random `ceil(gamma d)` positions every round"

    def mask_for(self, key, server_round, gamma, x) -> tuple[NDArray[np.bool_], str]:
        rng = np.random.default_rng([int(server_round), client_seed(key or "")])
        mask = np.zeros(x.size, dtype=bool)
        mask[rng.permutation(x.size)[: budget(gamma, x.size)]] = True
        return mask, "random"


@pytest.fixture
def random_topk():
    register(RandomTopK)
    yield RandomTopK
    unregister(RandomTopK.name)


def test_a_method_defined_in_a_test_runs_a_two_round_federation(random_topk, tmp_path, monkeypatch):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    run_config = {
        "method": "random-topk",
        "num-rounds": 2,
        "local-epochs": 1,
        "eval-every": 1,
        "seed": 3,
    }
    fed = inprocess_federation(run_config, {11: 1.0, 12: 0.25, 13: 0.0625})
    grid, strategy, records, x0, layout = (
        fed.grid,
        fed.strategy,
        fed.records,
        fed.x0,
        fed.strategy.layout,
    )
    assert isinstance(strategy.method, RandomTopK)
    result = strategy.start(
        grid,
        strategy.to_arrays(x0),
        fed.cfg.num_rounds,
        60.0,
        train_config=ConfigRecord({"note": "train"}),
        evaluate_config=ConfigRecord({"note": "evaluate"}),
        evaluate_fn=fed.evaluate_fn,
    )
    assert [r["round"] for r in records] == [0, 1, 2]
    for rec in records[1:]:
        assert rec["replies"] == rec["sent"] == 3
        for c in rec["clients"]:
            assert c["status"] == "ok" and c["mask_source"] == "random"
            assert c["selected"] == budget(c["capacity"], layout.size)
        assert rec["local"] is not None and 0 <= rec["local"]["accuracy"] <= 1
        assert set(rec["global"]["per_capacity"]) == {"1", "0.25", "0.0625"}
    assert not np.array_equal(strategy.x, x0)  # the replies were aggregated
    # Each client draws its own mask: the README's example seeds by the client's key, not by its
    # length.
    masks = {k: strategy.method.mask_for(k, 1, 0.25, x0)[0] for k in ("partition-1", "partition-2")}
    assert not np.array_equal(masks["partition-1"], masks["partition-2"])
    assert sorted(result.train_metrics_clientapp) == [1, 2] and sorted(
        result.evaluate_metrics_serverapp
    ) == [1, 2]
    assert records[-1]["global"]["accuracy"] == result.evaluate_metrics_serverapp[2]["accuracy"]
    by_type = {
        t: [m for m in grid.handled if m.metadata.message_type == t] for t in ("train", "evaluate")
    }
    assert len(by_type["train"]) == len(by_type["evaluate"]) == 6
    for (
        kind,
        msgs,
    ) in by_type.items():  # Strategy.start's train_config / evaluate_config reach every node
        assert all(m.content.config_records[P.CONFIG]["note"] == kind for m in msgs)


def test_registry_lists_every_method_and_rejects_unknown_names():
    assert list(registry())[:9] == [
        "fedfibos",
        "fiarse",
        "heterofl",
        "fedrolex",
        "fedavg",
        "fedavg-drop",
        "fedgmr",
        "cahfp",
        "lora",
    ]
    with pytest.raises(ConfigError, match="method='random-topk'"):
        parse_run_config({"method": "random-topk"})
    # LoRA adapts a pretrained text model (the config is only parsed: nothing is loaded)
    pretrained = {"model": "hf", "model-path": "org/model", "dataset": "ag_news"}
    for name in registry():
        extra = pretrained if name == "lora" else {}
        assert create_method(parse_run_config({"method": name, **extra})).name == name


def _method_name_comparisons(path: Path, names: set[str]) -> list[str]:
    """``==``, ``!=``, ``in`` or ``not in`` comparisons with a method name literal in a source
    file."""
    found = []

    def literals(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [v for elt in node.elts for v in literals(elt)]
        return []

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            hits = [
                v for side in (node.left, *node.comparators) for v in literals(side) if v in names
            ]
            if hits:
                found.append(f"{path}:{node.lineno}: {hits}")
        elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue):
            if set(literals(node.pattern.value)) & names:
                found.append(f"{path}:{node.lineno}: case")
    return found


def test_no_method_name_comparison_outside_the_methods_package():
    names = set(registry())
    methods_dir = ROOT / "common" / "methods"
    sources = [
        p
        for folder in ("server", "client", "common")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if methods_dir not in p.parents
    ]
    assert len(sources) > 30
    offenders = [hit for p in sources for hit in _method_name_comparisons(p, names)]
    assert offenders == [], (
        "method-specific behaviour belongs in common/methods/<name>.py:\n" + "\n".join(offenders)
    )


def test_the_name_check_finds_comparisons(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        'def f(m, cfg):\n    return m == "fiarse" or cfg.method in ("heterofl", "x") or m == '
        '"other"\n'
    )
    assert len(_method_name_comparisons(sample, set(registry()))) == 2
