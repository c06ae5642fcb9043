"""A node's local data (its partition, split into train and test), derived once and cached on the
node."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from common.config.node import NodeConfig
from common.config.run import RunConfig
from common.data.arrays import ArrayDataset
from common.data.catalog import TEXT_DATASETS
from common.data.local_split import LocalData, derive_local_data
from common.data.node_data import NodeDataReport

CACHE_VERSION = 4


def cache_dir() -> Path:
    """Where nodes keep their derived local splits (``FIBOS_CACHE_DIR`` overrides)."""
    return Path(os.environ.get("FIBOS_CACHE_DIR", Path(tempfile.gettempdir()) / "fibos-fl-cache"))


def folder_fingerprint(path: str) -> str:
    """A digest of every file's name, size and modification time under ``path`` (a folder or a
    file)."""
    root = Path(path).expanduser()
    digest = hashlib.sha256()
    files = (
        [root]
        if root.is_file()
        else sorted(p for p in root.rglob("*") if p.is_file())
        if root.is_dir()
        else []
    )
    for file in files:
        st = file.stat()
        digest.update(
            f"{file.relative_to(root) if file != root else file.name}\0{st.st_size}\0"
            f"{st.st_mtime_ns}\n".encode()
        )
    return digest.hexdigest()


def load_local_data(run: RunConfig, node: NodeConfig) -> LocalData:
    """This node's splits, from the cache when this exact split was derived before.

    Flower starts a fresh ClientApp process for every message; deriving the split
    imports scikit-learn, ``datasets`` and flwr-datasets (seconds per message on a
    small board), so the result is cached on the node, keyed by every setting it
    depends on.
    """
    key = _cache_key(run, node)
    path = cache_dir() / f"{run.dataset}-{key}.npz"
    if path.exists():
        try:
            z = np.load(path)
            nc = int(z["num_classes"])
            report = json.loads(str(z["report"])) if "report" in z.files else None
            return LocalData(
                ArrayDataset(z["train_x"], z["train_y"], nc),
                ArrayDataset(z["test_x"], z["test_y"], nc),
                None if report is None else NodeDataReport.from_dict(report),
            )
        except (OSError, ValueError, KeyError):
            path.unlink(missing_ok=True)  # torn or stale cache entry: derive again
    data = derive_local_data(run, node)
    _write_cache(path, data)
    return data


def _cache_key(run: RunConfig, node: NodeConfig) -> str:
    """The cache entry's key: a digest of every setting the node's split depends on.

    Parameters
    ----------
    run : RunConfig
        The run configuration (dataset, split and partitioning settings).
    node : NodeConfig
        The node's own configuration (its capacity and device do not change the split).
    """
    key_fields = {
        "v": CACHE_VERSION,
        "dataset": run.dataset,
        "data_path": run.data_path,
        # Text is encoded for the model: hashed words, or the tokens of the tokenizer at model-path.
        "text": [run.model, run.model_path, run.text_length]
        if run.dataset in TEXT_DATASETS
        else None,
        "test_fraction": run.test_fraction,
        "local_test_fraction": run.local_test_fraction,
        "seed": run.seed,
        "partitioner": run.partitioner,
        "alpha": run.dirichlet_alpha,
        "classes": run.classes_per_client,
        "node": node.model_dump() | {"capacity": None, "device": None},
        # The node's own data: the run's label space and input shape, and the folder as it is now
        # (an edit to the folder is a new entry).
        "node_data": [
            run.classes,
            run.image_size,
            run.image_channels,
            folder_fingerprint(node.data_path),
        ]
        if node.data_path
        else None,
    }
    if run.node_groups > 1:
        # Only then: one group (the default) keeps the keys of entries derived before groups.
        key_fields["groups"] = [run.node_groups, run.group_shift]
    return hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:24]


def _write_cache(path: Path, data: LocalData) -> None:
    """Write a derived split to the cache, atomically (a concurrent reader never sees a torn file).

    Parameters
    ----------
    path : Path
        The cache entry (``.npz``); its folder is created when missing.
    data : LocalData
        The split derived for this node.
    """
    buf = io.BytesIO()
    np.savez(
        buf,
        train_x=data.train.x,
        train_y=data.train.y,
        test_x=data.test.x,
        test_y=data.test.y,
        num_classes=data.train.num_classes,
        **({"report": json.dumps(asdict(data.report))} if data.report is not None else {}),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)
