"""The AG News text model: fastText-style bag of hashed-token embeddings, through the client
code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config.node import NodeConfig
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.hub import TEXT_VOCAB, hash_tokens
from common.data.local_split import derive_local_data
from common.fisher.selection import select_mask
from common.models.architectures import FastText, build_model, model_layout, trainable_arrays
from common.training.evaluation import evaluate
from common.training.loop import TrainConfig, train_masked
from tests.tiny_text import news_texts

datasets = pytest.importorskip("datasets")


def _news(n: int, rng: np.random.Generator):
    """AG News' schema (text, 4-class label) with topic words that make the label learnable."""
    texts, labels = news_texts(n, rng, words=12)
    feats = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(num_classes=4)}
    )
    return datasets.Dataset.from_dict({"text": texts, "label": labels}, feats)


def test_padding_is_ignored_and_ids_fit_the_vocabulary() -> None:
    ids = hash_tokens(["Stocks rally after the merger", "team wins"], length=16)
    assert ids.min() >= 0 and ids.max() < TEXT_VOCAB
    model = build_model("fasttext", 4, 1, seed=0).eval()
    short = torch.from_numpy(ids[:, :8])
    padded = torch.from_numpy(
        np.concatenate([ids[:, :8], np.zeros((2, 24), dtype=np.int64)], axis=1)
    )
    assert torch.allclose(model(short), model(padded), atol=1e-6)
    assert isinstance(model, FastText) and model(short).shape == (2, 4)
    again = build_model("fasttext", 4, 1, seed=0)  # the server's initial model is reproducible
    assert all(
        np.array_equal(a, b)
        for a, b in zip(trainable_arrays(model).values(), trainable_arrays(again).values())
    )


def test_text_datasets_and_models_must_match() -> None:
    with pytest.raises(ConfigError, match="text models"):
        parse_run_config({"dataset": "ag_news"})  # the default model is the image CNN
    with pytest.raises(ConfigError, match="text models"):
        parse_run_config({"dataset": "digits", "model": "fasttext"})
    assert parse_run_config({"dataset": "ag_news", "model": "fasttext"}).model == "fasttext"


def test_fisher_submodel_of_fasttext_learns_news_topics_through_the_client_code(tmp_path) -> None:
    """At 1/16 of the weights the Fisher rule keeps the embedding rows of the tokens that occur;
    magnitude does not."""
    rng = np.random.default_rng(0)
    disk = tmp_path / "ag_news"
    datasets.DatasetDict({"train": _news(400, rng), "test": _news(100, rng)}).save_to_disk(
        str(disk)
    )
    run = parse_run_config(
        {
            "dataset": "ag_news",
            "model": "fasttext",
            "data-path": str(disk),
            "batch-size": 16,
            "seed": 1,
        }
    )
    data = derive_local_data(run, NodeConfig(partition_id=0, num_partitions=2, capacity=0.0625))
    model = build_model("fasttext", data.train.num_classes, 1, run.seed)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    cpu = torch.device("cpu")
    # round 1 of a federation: a first Fisher estimate from a pass over the client's data
    first = train_masked(
        model, layout, x, np.ones(layout.size, dtype=bool), data.train, TrainConfig(1, 16, 0.1), cpu
    )
    accuracy = {}
    for rule in ("fisher", "magnitude"):
        mask = select_mask(layout, x, 0.0625, rule, first.fisher if rule == "fisher" else None)
        model = build_model("fasttext", 4, 1, run.seed)
        res = train_masked(
            model, layout, x, mask, data.train, TrainConfig(8, 16, 0.5, momentum=0.9), cpu
        )
        assert not res.params[~mask].any()  # the client trained its submodel only
        assert np.all(np.isfinite(res.fisher))
        accuracy[rule] = evaluate(model, data.test, cpu)[1]
    assert accuracy["fisher"] > 0.9, accuracy  # 4 classes: chance is 0.25
    assert accuracy["fisher"] > accuracy["magnitude"] + 0.2, accuracy
