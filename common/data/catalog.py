"""The names the run config accepts for data: datasets, partitioners, and a run's own class names.

Kept free of numpy, torch and the loaders so that checking a configuration imports none of them.
"""

from __future__ import annotations

from collections import Counter

OFFLINE_DATASETS: tuple[str, ...] = ("digits", "mnist5k", "rotten_tomatoes")
# Through Hugging Face datasets (common.data.hub): hub or a local copy (run-config data-path).
HUB_DATASET_NAMES: tuple[str, ...] = ("cifar10", "cifar100", "fashion_mnist", "femnist", "ag_news")
#: Each node reads its own folder (node-config ``data-path``, :mod:`common.data.node_data`); the run
#: names the classes.
NODE_DATASET = "node"
DATASETS: tuple[str, ...] = OFFLINE_DATASETS + HUB_DATASET_NAMES + (NODE_DATASET,)
TEXT_DATASETS: tuple[str, ...] = (
    "ag_news",
    "rotten_tomatoes",
)  # token ids, for the text models of common.models.architectures

PARTITIONERS: tuple[str, ...] = ("iid", "dirichlet", "pathological", "natural")


def parse_classes(value: str, key: str = "classes") -> tuple[str, ...]:
    """The run's class names: ``"cat,dog,bird"``, or a count ``"10"`` for the names ``"0"`` to
    ``"9"``.

    Raises ``ValueError`` naming ``key`` for fewer than two classes, an empty name or a repeated
    one.
    """
    text = value.strip()
    if text.isdigit():
        count = int(text)
        if count < 2:
            raise ValueError(f"{key}={value!r}: a run needs at least 2 classes")
        return tuple(str(i) for i in range(count))
    names = tuple(n.strip() for n in text.split(","))
    if len(names) < 2:
        raise ValueError(
            f"{key}={value!r}: name at least 2 classes, comma-separated (or give their count)"
        )
    if any(not n for n in names):
        raise ValueError(
            f"{key}={value!r}: a class name is empty (two commas in a row, or one at an end)"
        )
    repeated = sorted(n for n, c in Counter(names).items() if c > 1)
    if repeated:
        raise ValueError(f"{key}={value!r}: class name(s) {repeated} appear more than once")
    return names
