"""``fibos bench-text-recipe``: recipes parsed, the model trained as each says, the rows and files
written."""

from __future__ import annotations

import argparse
import csv

import numpy as np
import pytest
import torch

from benchmarks.text_recipe_bench import (
    Recipe,
    RecipeRow,
    build_recipe_model,
    main,
    table,
    train_recipe,
)
from common.data.arrays import ArrayDataset

pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_a_recipe_names_part_optimizer_and_step() -> None:
    assert Recipe.parse("lora:adamw:3e-3") == Recipe("lora", "adamw", 0.003)
    assert Recipe.parse("full:sgd:0.05").label == "full:sgd:0.05"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("full:sgd", "<part>:<optimizer>:<lr>"),
        ("head:sgd:0.1", "part 'head'"),
        ("full:adam:0.1", "optimizer 'adam'"),
        ("full:sgd:fast", "lr 'fast'"),
        ("full:sgd:0", "above 0"),
    ],
)
def test_a_bad_recipe_is_refused_naming_what_is_wrong(text, named) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=named):
        Recipe.parse(text)


def _data(n: int, length: int, rng: np.random.Generator) -> ArrayDataset:
    return ArrayDataset(rng.integers(5, 30, (n, length)).astype(np.int64), rng.integers(0, 2, n), 2)


def test_lora_trains_only_the_adapters_and_head_and_full_every_unfrozen_weight(text_setup) -> None:
    model_path, _ = text_setup
    rng = np.random.default_rng(0)
    train, test = _data(40, 8, rng), _data(20, 8, rng)
    batches = rng.integers(0, 40, (4, 8))
    counts = {}
    for part in ("full", "lora"):
        recipe = Recipe(part, "adamw", 1e-2)
        model = build_recipe_model(recipe, model_path, 2, 0, "frozen", 2, 4.0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        rows = train_recipe(
            model, recipe, train, test, batches, eval_every=3, momentum=0.9, clip_grad_norm=1.0
        )
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert moved == trainable  # every trained weight moved; nothing frozen did
        assert not any(
            n.endswith("_embeddings.weight") for n in moved
        )  # embedding tables stay frozen
        if part == "lora":
            assert all("lora_" in n or "classifier" in n for n in moved)
        # step 0 before training, every eval_every steps, and the last step
        assert [r.step for r in rows] == [0, 3, 4]
        assert all(0 <= r.test_acc <= 1 for r in rows) and np.isnan(rows[0].train_loss)
        assert rows[-1].trained_weights == sum(
            p.numel() for p in model.parameters() if p.requires_grad
        )
        counts[part] = rows[-1].trained_weights
    assert counts["lora"] < counts["full"]


def test_the_table_gives_each_recipe_its_accuracy_per_step() -> None:
    rows = [
        RecipeRow("full:sgd:0.05", "full", "sgd", 0.05, 0, float("nan"), 0.5, float("nan"), 10),
        RecipeRow("full:sgd:0.05", "full", "sgd", 0.05, 30, 0.6, 0.625, 0.2, 10),
        RecipeRow(
            "lora:adamw:0.003", "lora", "adamw", 0.003, 0, float("nan"), 0.5, float("nan"), 4
        ),
    ]
    text = table(rows)
    assert "| recipe | trained weights | acc @0 | acc @30 | final loss | s per step |" in text
    assert "| full:sgd:0.05 | 10 | 0.500 | 0.625 | 0.600 | 0.20 |" in text
    assert "| lora:adamw:0.003 | 4 | 0.500 | - | nan | nan |" in text


def test_the_command_writes_rows_and_plot(text_setup, tmp_path, capsys) -> None:
    model_path, data_path = text_setup
    out = tmp_path / "recipe"
    argv = [
        "--model-path",
        model_path,
        "--dataset",
        "ag_news",
        "--data-path",
        data_path,
        "--text-length",
        "8",
    ]
    argv += [
        "--recipes",
        "full:sgd:0.05,lora:adamw:1e-2",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--batch-size",
        "8",
    ]
    assert main([*argv, "--lora-rank", "2", "--out", str(out)]) == 0
    with open(out / "text_recipe.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["recipe"], int(r["step"])) for r in rows] == [
        (label, step) for label in ("full:sgd:0.05", "lora:adamw:0.01") for step in (0, 2, 4)
    ]
    assert (out / "text_recipe.png").stat().st_size > 0 and (out / "text_recipe.json").exists()
    assert "| lora:adamw:0.01 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "value"), [("--steps", "0"), ("--recipes", "full:sgd"), ("--test-examples", "-1")]
)
def test_bad_flags_fail_naming_the_flag(flag, value, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main([flag, value, "--model-path", "unused", "--out", str(tmp_path)])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
