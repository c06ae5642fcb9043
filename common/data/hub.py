"""Online datasets through Hugging Face ``datasets``, or from a local copy for air-gapped sites.

Each dataset is described by its hub id and the columns that hold the input
and the label. ``path`` (run-config ``data-path``) points at a local copy
instead of the hub: a folder written by ``DatasetDict.save_to_disk`` /
``Dataset.save_to_disk``, or a folder (or glob) of parquet files, one file per
split named ``train*.parquet`` / ``test*.parquet``.

Images are kept as uint8 ``(n, channels, height, width)`` arrays (CIFAR-10 as
float32 would need 600 MB); training scales them to [0, 1] per batch.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from common.data.arrays import ArrayDataset, SplitDataset


@dataclass(frozen=True)
class HubSpec:
    """Where a dataset lives on the hub and which columns matter.

    Parameters
    ----------
    hub_id : str
        Hugging Face dataset id.
    input_column : str
        Image (PIL / ``Image`` feature) or text column.
    label_column : str
        Integer label column.
    num_classes : int
        Number of labels.
    channels : int
        Image channels (0 for text).
    group_column : str or None
        Natural partition key (e.g. FEMNIST's writer), used by ``partitioner = natural``.
    """

    hub_id: str
    input_column: str
    label_column: str
    num_classes: int
    channels: int
    group_column: str | None = None


HUB_DATASETS: dict[str, HubSpec] = {
    "cifar10": HubSpec("uoft-cs/cifar10", "img", "label", 10, 3),
    "cifar100": HubSpec("uoft-cs/cifar100", "img", "fine_label", 100, 3),
    "fashion_mnist": HubSpec("zalando-datasets/fashion_mnist", "image", "label", 10, 1),
    "femnist": HubSpec("flwrlabs/femnist", "image", "character", 62, 1, group_column="writer_id"),
    "ag_news": HubSpec("fancyzhx/ag_news", "text", "label", 4, 0),
}
TEXT_LENGTH = 64  # tokens per AG News example
TEXT_VOCAB = 2**15  # hashed vocabulary size


def _read(name: str, path: str | None) -> dict[str, Any]:
    """Splits of the raw dataset as ``{split: datasets.Dataset}``."""
    import datasets

    spec = HUB_DATASETS[name]
    if not path:
        return dict(datasets.load_dataset(spec.hub_id))
    if os.path.isdir(path) and (
        os.path.exists(os.path.join(path, "dataset_dict.json"))
        or os.path.exists(os.path.join(path, "state.json"))
    ):
        loaded = datasets.load_from_disk(path)
        return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    files = sorted(glob.glob(os.path.join(path, "*.parquet") if os.path.isdir(path) else path))
    if not files:
        raise FileNotFoundError(
            f"data-path {path!r} holds neither a save_to_disk folder nor parquet files"
        )
    by_split: dict[str, list[str]] = {}
    for f in files:
        split = "test" if os.path.basename(f).startswith("test") else "train"
        by_split.setdefault(split, []).append(f)
    return dict(datasets.load_dataset("parquet", data_files=by_split))


def _check_columns(name: str, split: str, columns: list[str]) -> None:
    spec = HUB_DATASETS[name]
    wanted = [spec.input_column, spec.label_column] + (
        [spec.group_column] if spec.group_column else []
    )
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise ValueError(
            f"dataset {name!r} split {split!r} lacks column(s) {missing}; it has {columns}"
        )


def _images(column: list[Any], channels: int) -> NDArray[np.uint8]:
    """PIL images (or decoded dicts) -> uint8 ``(n, c, h, w)``."""
    out = []
    for img in column:
        arr = np.asarray(img.convert("RGB" if channels == 3 else "L"), dtype=np.uint8)
        out.append(arr.transpose(2, 0, 1) if arr.ndim == 3 else arr[None])
    return np.stack(out) if out else np.zeros((0, channels, 1, 1), np.uint8)


def hash_tokens(
    texts: Sequence[str], length: int = TEXT_LENGTH, vocab: int = TEXT_VOCAB
) -> NDArray[np.int64]:
    """Lower-cased whitespace tokens hashed (stable crc32) into ``[1, vocab)``, padded with 0."""
    import zlib

    out = np.zeros((len(texts), length), dtype=np.int64)
    for i, text in enumerate(texts):
        ids = [1 + zlib.crc32(t.encode()) % (vocab - 1) for t in text.lower().split()[:length]]
        out[i, : len(ids)] = ids
    return out


def _convert(
    name: str, ds: Any, encode: Callable[[Sequence[str]], NDArray[np.int64]] | None = None
) -> ArrayDataset:
    spec = HUB_DATASETS[name]
    labels = np.asarray(ds[spec.label_column], dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= spec.num_classes):
        raise ValueError(f"dataset {name!r}: labels outside [0, {spec.num_classes})")
    if spec.channels == 0:
        x = (encode or hash_tokens)(list(ds[spec.input_column]))
    else:
        x = _images(ds[spec.input_column], spec.channels)
    groups = _group_ids(ds[spec.group_column]) if spec.group_column else None
    return ArrayDataset(x, labels, spec.num_classes, groups)


def _group_ids(column: Sequence[Any]) -> NDArray[np.int64]:
    """Natural group values (e.g. FEMNIST writers) as ids ``0..k-1``, numbered in sorted order of
    the values."""
    return np.unique(np.asarray(column).astype(str), return_inverse=True)[1].astype(np.int64)


def _pool_rows(
    labels: NDArray[np.int64], test_fraction: float, seed: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Rows of a ``train`` split without a ``test`` split: the training pool's and the held-out test
    set's.

    ``test_fraction`` of the rows is held out, stratified by label when every label present has two
    rows.
    """
    from sklearn.model_selection import train_test_split

    idx = np.arange(labels.shape[0])
    counts = np.bincount(labels)
    stratify = labels if counts[counts > 0].min() >= 2 else None
    tr, te = train_test_split(idx, test_size=test_fraction, random_state=seed, stratify=stratify)
    return np.sort(tr), np.sort(te)


def _splits(name: str, path: str | None) -> dict[str, Any]:
    if name not in HUB_DATASETS:
        raise ValueError(f"unknown hub dataset {name!r}; expected one of {sorted(HUB_DATASETS)}")
    splits = _read(name, path)
    for split, ds in splits.items():
        _check_columns(name, split, list(ds.column_names))
    if "train" not in splits:
        raise ValueError(f"dataset {name!r} has no 'train' split (found {sorted(splits)})")
    return splits


def load_hub_dataset(
    name: str,
    test_fraction: float,
    seed: int,
    path: str | None = None,
    encode: Callable[[Sequence[str]], NDArray[np.int64]] | None = None,
) -> SplitDataset:
    """Load a hub dataset (or its local copy) as a training pool and a server test set.

    The dataset's own ``test`` split is the server's test set when it exists;
    otherwise ``test_fraction`` of the examples is held out (stratified, seeded).
    ``encode`` turns a text dataset's texts into token ids (``None``: hashed words).
    """
    splits = _splits(name, path)
    train = _convert(name, splits["train"], encode)
    if "test" in splits:
        return SplitDataset(train, _convert(name, splits["test"], encode))
    tr, te = _pool_rows(train.y, test_fraction, seed)
    return SplitDataset(train.subset(tr), train.subset(te))


def load_hub_partition(
    name: str,
    test_fraction: float,
    seed: int,
    select: Callable[[NDArray[np.int64], NDArray[np.int64] | None], NDArray[np.int64]],
    path: str | None = None,
    encode: Callable[[Sequence[str]], NDArray[np.int64]] | None = None,
) -> ArrayDataset:
    """One node's part of a hub dataset's training pool, decoding only that part's images or texts.

    The pool is the one :func:`load_hub_dataset` returns (``train`` less the held-out test rows);
    ``select`` gets the pool's labels (and natural groups, if the dataset has them) and returns the
    positions in the pool this node holds. The result equals
    ``load_hub_dataset(...).train.subset(positions)``, but only the label (and group) column is read
    for the whole pool: a node pays for its own partition, not for everyone's.
    """
    splits = _splits(name, path)
    spec = HUB_DATASETS[name]
    raw = splits["train"]
    labels = np.asarray(raw[spec.label_column], dtype=np.int64)
    pool = (
        np.arange(labels.shape[0])
        if "test" in splits
        else _pool_rows(labels, test_fraction, seed)[0]
    )
    groups = None
    if spec.group_column:
        groups = _group_ids(raw[spec.group_column])[pool]
    positions = np.asarray(select(labels[pool], groups), dtype=np.int64)
    part = _convert(name, raw.select(pool[positions].tolist()), encode)
    if groups is not None:  # group ids of the whole pool, as load_hub_dataset numbers them
        part = ArrayDataset(part.x, part.y, part.num_classes, groups[positions])
    return part
