"""The Hugging Face model path (``model = "hf"``): loading, the tensor rule, federations, bad
input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.datasets import load_run_dataset
from common.models.architectures import build_run_model, model_layout, trainable_arrays
from common.models.hf import HFClassifier, build_hf_model, tokenize
from common.training.evaluation import evaluate
from tests.inprocess_grid import inprocess_federation
from tests.tiny_text import tiny_bert, tiny_text_run

pytest.importorskip("transformers")
pytest.importorskip("datasets")


def _run(model_path: str, data_path: str, **extra) -> dict:
    return tiny_text_run(model_path, data_path, **extra)


def test_model_takes_the_dataset_labels_its_tokenizer_and_the_embedding_rule(text_setup) -> None:
    model_path, data_path = text_setup
    run = parse_run_config(_run(model_path, data_path))
    split = load_run_dataset(run)
    assert split.train.x.shape[1] == 12 and split.train.x[:, 0].tolist() == [2] * len(
        split.train
    )  # [CLS] first
    model = build_run_model(run, split.train.num_classes, split.train.in_channels)
    assert isinstance(model, HFClassifier) and model.net.config.num_labels == 4
    layout = model_layout(model)
    assert not any(
        "embeddings." in n and n.endswith("embeddings.weight") for n in layout.names
    )  # frozen
    kept = layout.unflatten(layout.always_kept)
    norms = [n for n in layout.names if "LayerNorm" in n]
    assert norms and all(kept[n].all() for n in norms)  # LayerNorm is 1-D: always kept, like biases
    again = build_run_model(
        run, 4, 1
    )  # the head comes from the seed: the server and every node agree
    assert all(
        np.array_equal(a, b)
        for a, b in zip(trainable_arrays(model).values(), trainable_arrays(again).values())
    )
    trained = build_run_model(
        parse_run_config(_run(model_path, data_path, **{"hf-embeddings": "trained"})), 4, 1
    )
    extra = set(model_layout(trained).names) - set(layout.names)
    assert {n.rsplit(".", 2)[-2] for n in extra} == {
        "word_embeddings",
        "position_embeddings",
        "token_type_embeddings",
    }
    # padding is masked out of attention: extra padding does not change the logits
    ids = torch.from_numpy(tokenize(["team wins the league"], model_path, 8))
    padded = torch.from_numpy(tokenize(["team wins the league"], model_path, 16))
    model.eval()
    assert torch.allclose(model(ids), model(padded), atol=1e-5)


@pytest.mark.parametrize("method", ["fedfibos", "fiarse", "fedavg", "fedavg-drop", "fedgmr"])
def test_federation_of_a_pretrained_transformer(text_setup, method, tmp_path, monkeypatch) -> None:
    """Two rounds of FedFIbOS at three capacities; one round of every other element-wise method."""
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    model_path, data_path = text_setup
    rounds = 2 if method == "fedfibos" else 1
    capacities = {11: 1.0, 12: 0.25, 13: 0.0625} if method == "fedfibos" else {11: 1.0, 12: 0.0625}
    run_config = _run(
        model_path, data_path, method=method, **{"num-rounds": rounds, "eval-every": rounds}
    )
    fed = inprocess_federation(run_config, capacities)
    result = fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), rounds, 60.0, evaluate_fn=fed.evaluate_fn
    )
    records, layout = fed.records, fed.strategy.layout
    assert [r["round"] for r in records] == list(range(rounds + 1))
    for rec in records[1:]:
        assert rec["replies"] == (1 if method == "fedavg-drop" else len(capacities)), rec
        assert all(c["status"] == "ok" for c in rec["clients"])
        if method in ("fedfibos", "fiarse", "fedgmr"):
            small = min(rec["clients"], key=lambda c: c["capacity"])
            assert small["selected"] < layout.size  # a real submodel of the transformer
    if method == "fedfibos":
        # Under the byte budget only the capacity-1 node measures its Fisher, once its ledger
        # affords a payload of a row mean per output unit (this transformer has many short rows:
        # round 2); the smaller nodes cannot afford the rest of the model and are ranked by
        # magnitude, then by that node's Fisher.
        asked = {c["capacity"] for r in records[1:] for c in r["clients"] if c["fisher_asked"]}
        assert asked == {1.0}
        assert {
            c["mask_source"] for r in records[1:] for c in r["clients"] if c["capacity"] < 1
        } <= {
            "magnitude",
            "prior",
        }
    assert not np.array_equal(fed.strategy.x, fed.x0)
    assert np.all(np.isfinite(fed.strategy.x))
    assert sorted(result.evaluate_metrics_serverapp) == list(range(1, rounds + 1))


def test_bad_model_input_fails_fast_naming_the_key(text_setup, tmp_path) -> None:
    model_path, data_path = text_setup
    with pytest.raises(ConfigError, match="model-path is empty"):
        parse_run_config({"dataset": "ag_news", "model": "hf"})
    with pytest.raises(ConfigError, match="model-path=.*leave model-path empty"):
        parse_run_config(
            {"model-path": model_path}
        )  # the default image CNN is not loaded from a path
    with pytest.raises(ConfigError, match="text models"):
        parse_run_config({"dataset": "digits", "model": "hf", "model-path": model_path})
    run = parse_run_config(_run(str(tmp_path / "nowhere"), data_path))
    with pytest.raises(ConfigError, match="model-path=.*no such model folder"):
        build_run_model(run, 4, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="model-path=.*holds no model"):
        build_hf_model(str(tmp_path / "empty"), 4, 0)
    mismatched = tiny_bert(tmp_path / "mismatch", extra_tokens=5)
    with pytest.raises(ConfigError, match="model-path=.*do not belong together"):
        build_hf_model(str(mismatched), 4, 0)


def test_a_client_trains_only_its_held_transformer_weights(text_setup) -> None:
    from common.fisher.selection import select_mask
    from common.training.loop import TrainConfig, train_masked

    model_path, data_path = text_setup
    run = parse_run_config(_run(model_path, data_path))
    split = load_run_dataset(run)
    train = split.train.subset(np.arange(48))
    model = build_run_model(run, 4, 1)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    mask = select_mask(layout, x, 0.25, "magnitude")
    cpu = torch.device("cpu")
    res = train_masked(
        model, layout, x, mask, train, TrainConfig(1, 16, 0.05, momentum=0.9), cpu, True
    )
    assert not res.params[~mask].any() and not np.array_equal(res.params[mask], x[mask])
    assert (
        res.fisher.shape == (layout.size,) and (res.fisher[~mask] > 0).any()
    )  # unheld positions measured too
    assert 0 <= evaluate(model, split.test, cpu)[1] <= 1
