"""Hub dataset loaders on small local fixtures with each dataset's real schema (never a
download)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config.node import NodeConfig
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.catalog import HUB_DATASET_NAMES
from common.data.datasets import load_dataset
from common.data.hub import HUB_DATASETS, hash_tokens
from common.data.local_split import derive_local_data
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.training.evaluation import evaluate
from common.training.loop import TrainConfig, train_masked

datasets = pytest.importorskip("datasets")
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value  # noqa: E402


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _images(n, size, mode, rng):
    from PIL import Image as PILImage

    shape = (size, size, 3) if mode == "RGB" else (size, size)
    return [PILImage.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode) for _ in range(n)]


def _fixture(name: str, n: int, rng) -> Dataset:
    """A few rows with the column names and feature types of the real hub dataset."""
    if name == "cifar10":
        feats = Features({"img": Image(), "label": ClassLabel(num_classes=10)})
        return Dataset.from_dict(
            {"img": _images(n, 32, "RGB", rng), "label": list(rng.integers(0, 10, n))}, feats
        )
    if name == "cifar100":
        feats = Features(
            {
                "img": Image(),
                "fine_label": ClassLabel(num_classes=100),
                "coarse_label": ClassLabel(num_classes=20),
            }
        )
        return Dataset.from_dict(
            {
                "img": _images(n, 32, "RGB", rng),
                "fine_label": list(rng.integers(0, 100, n)),
                "coarse_label": list(rng.integers(0, 20, n)),
            },
            feats,
        )
    if name == "fashion_mnist":
        feats = Features({"image": Image(), "label": ClassLabel(num_classes=10)})
        return Dataset.from_dict(
            {"image": _images(n, 28, "L", rng), "label": list(rng.integers(0, 10, n))}, feats
        )
    if name == "femnist":
        feats = Features(
            {
                "image": Image(),
                "writer_id": Value("string"),
                "hsf_id": Value("int64"),
                "character": ClassLabel(num_classes=62),
            }
        )
        return Dataset.from_dict(
            {
                "image": _images(n, 28, "L", rng),
                "writer_id": [f"f{w:04d}_{w % 7:02d}" for w in rng.integers(0, 4, n)],
                "hsf_id": list(rng.integers(0, 8, n)),
                "character": list(rng.integers(0, 62, n)),
            },
            feats,
        )
    if name == "ag_news":
        feats = Features({"text": Value("string"), "label": ClassLabel(num_classes=4)})
        words = ["stocks", "fall", "team", "wins", "new", "chip", "election", "rally"]
        texts = [" ".join(rng.choice(words, 12)) for _ in range(n)]
        return Dataset.from_dict({"text": texts, "label": list(rng.integers(0, 4, n))}, feats)
    raise AssertionError(name)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("hub")
    out = {}
    for name in HUB_DATASETS:
        with_test = name != "femnist"  # FEMNIST on the hub has a single train split
        splits = {"train": _fixture(name, 40, rng)} | (
            {"test": _fixture(name, 12, rng)} if with_test else {}
        )
        disk = root / name / "disk"
        DatasetDict(splits).save_to_disk(str(disk))
        parquet = root / name / "parquet"
        parquet.mkdir(parents=True)
        for split, ds in splits.items():
            ds.to_parquet(str(parquet / f"{split}-00000-of-00001.parquet"))
        out[name] = (disk, parquet, with_test)
    return out


def test_every_hub_dataset_is_listed():
    assert set(HUB_DATASET_NAMES) == set(HUB_DATASETS)


@pytest.mark.parametrize("name", sorted(HUB_DATASETS))
@pytest.mark.parametrize("form", ["disk", "parquet"])
def test_loader_reads_local_copy_with_real_schema(fixtures, name, form):
    disk, parquet, with_test = fixtures[name]
    split = load_dataset(name, 0.25, 0, str(disk if form == "disk" else parquet))
    spec = HUB_DATASETS[name]
    assert len(split.train) == (40 if with_test else 30) and len(split.test) == (
        12 if with_test else 10
    )
    assert split.train.num_classes == spec.num_classes
    assert split.train.y.dtype == np.int64 and split.train.y.max() < spec.num_classes
    if spec.channels:
        side = 32 if spec.channels == 3 else 28
        assert (
            split.train.x.shape[1:] == (spec.channels, side, side)
            and split.train.x.dtype == np.uint8
        )
    else:
        assert split.train.x.shape[1:] == (64,) and split.train.x.dtype == np.int64
    assert (split.train.groups is not None) == (name == "femnist")


def test_loader_rejects_wrong_schema(tmp_path):
    Dataset.from_dict({"picture": [1, 2], "label": [0, 1]}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="lacks column"):
        load_dataset("cifar10", 0.5, 0, str(tmp_path / "bad"))
    with pytest.raises(FileNotFoundError, match="data-path"):
        load_dataset("cifar10", 0.5, 0, str(tmp_path / "empty"))


def test_cifar10_fixture_trains_through_the_client_code(fixtures):
    disk, _, _ = fixtures["cifar10"]
    run = parse_run_config(
        {"dataset": "cifar10", "data-path": str(disk), "partitioner": "iid", "batch-size": 8}
    )
    data = derive_local_data(run, NodeConfig(partition_id=0, num_partitions=2, capacity=0.5))
    model = build_model("cnn", 10, 3, 0)
    layout = model_layout(model)
    x = layout.flatten(trainable_arrays(model))
    mask = np.ones(layout.size, dtype=bool)
    res = train_masked(
        model, layout, x, mask, data.train, TrainConfig(1, 8, 0.05), torch.device("cpu")
    )
    assert np.isfinite(res.loss) and not np.array_equal(res.params, x)
    loss, acc = evaluate(model, data.test, torch.device("cpu"))
    assert np.isfinite(loss) and 0 <= acc <= 1


def test_femnist_natural_partition_is_one_writer_per_client(fixtures):
    disk, _, _ = fixtures["femnist"]
    run = parse_run_config({"dataset": "femnist", "data-path": str(disk), "partitioner": "natural"})
    pool = load_dataset("femnist", run.test_fraction, run.seed, str(disk)).train
    writers = len(np.unique(pool.groups))
    seen = []
    for pid in range(writers):
        data = derive_local_data(
            run, NodeConfig(partition_id=pid, num_partitions=writers, capacity=1.0)
        )
        seen.append(len(data.train) + len(data.test))
    assert sum(seen) == len(pool)
    with pytest.raises(ValueError, match="groups"):
        derive_local_data(run, NodeConfig(partition_id=0, num_partitions=writers + 1, capacity=1.0))


def test_text_and_natural_partition_config_guards():
    with pytest.raises(ConfigError, match="text model"):
        parse_run_config({"dataset": "ag_news"})
    with pytest.raises(ConfigError, match="natural"):
        parse_run_config({"dataset": "digits", "partitioner": "natural"})
    ids = hash_tokens(["Stocks fall", "stocks FALL again"])
    assert ids[0, 0] == ids[1, 0] and ids[0, 1] == ids[1, 1] and ids[0, 2] == 0 and ids[1, 2] > 0


@pytest.mark.parametrize("name", ["cifar10", "femnist", "ag_news"])
def test_a_node_decodes_only_its_own_partition_and_gets_what_the_whole_pool_gave(
    fixtures, name, monkeypatch
):
    import common.data.hub as hf
    from common.data.partitioning import partition_indices

    disk, _, _ = fixtures[name]
    partitioner = "natural" if name == "femnist" else "dirichlet"
    model = {"model": "fasttext"} if name == "ag_news" else {}
    run = parse_run_config(
        {"dataset": name, "data-path": str(disk), "partitioner": partitioner, "seed": 3, **model}
    )
    pool = load_dataset(name, run.test_fraction, run.seed, str(disk)).train
    parts = len(np.unique(pool.groups)) if name == "femnist" else 3
    decoded = []
    convert = hf._convert
    monkeypatch.setattr(
        hf, "_convert", lambda n, ds, encode=None: decoded.append(len(ds)) or convert(n, ds, encode)
    )
    for pid in range(parts):
        decoded.clear()
        data = derive_local_data(
            run, NodeConfig(partition_id=pid, num_partitions=parts, capacity=1.0)
        )
        idx = partition_indices(
            pool.y, partitioner, parts, pid, run.seed, run.dirichlet_alpha, groups=pool.groups
        )
        assert decoded == [idx.size]  # the partition's rows only, not the pool's
        got = np.concatenate([data.train.y, data.test.y])
        assert sorted(got.tolist()) == sorted(pool.y[idx].tolist())
        whole = pool.subset(idx)
        for split in (data.train, data.test):  # each example is the pool's, bit for bit
            rows = {whole.x[i].tobytes() for i in range(len(whole))}
            assert all(split.x[i].tobytes() in rows for i in range(len(split)))
