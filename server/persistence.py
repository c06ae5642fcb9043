"""Atomic writes of the run's outputs: metrics.json, the model, the Fisher state and the checkpoint.

Every file is written to a temporary name in the same folder, flushed to disk
and renamed over the old one (the folder flushed too), so a reader (or a
crash) never sees a torn file.

The checkpoint is incremental. The method's state (for Fisher-ranked methods
several GB at the papers' scale) is cut into chunks of :data:`CHUNK_BYTES`,
each stored once under its content hash in ``checkpoint.npz.chunks/``;
``checkpoint.npz`` holds the round, the global vector and the list of chunks.
A round writes only chunks not already stored (the Fisher state keeps an
unchanged client's bytes in place, see :meth:`common.fisher.state.FisherState.to_bytes`),
then replaces ``checkpoint.npz``, then deletes the chunks nothing refers to:
a crash at any point leaves the previous or the new checkpoint whole.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    import torch


def atomic_write(path: Path, data: bytes | memoryview, sync_dir: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (``sync_dir=False``: the caller flushes the folder
    afterwards)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make renames and deletions in ``folder`` durable (a no-op where folders cannot be opened,
    e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class MetricsLog:
    """``metrics.json``: a JSON object with the run's settings and one record per round.

    Parameters
    ----------
    path : Path
        Where to write.
    run : dict
        Run settings stored next to the rounds.
    """

    def __init__(self, path: Path, run: dict[str, Any], keep_until: int | None = None) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"run": run, "rounds": []}
        if keep_until is not None and path.exists():  # resuming: keep the completed rounds
            earlier = json.loads(path.read_text())
            self.doc["rounds"] = [r for r in earlier["rounds"] if r["round"] <= keep_until]
            if earlier.get("restarts"):  # the launcher's records of how the run came to be resumed
                self.doc["restarts"] = earlier["restarts"]

    def append(self, record: dict[str, Any]) -> None:
        """Add a round record and rewrite the file."""
        self.doc["rounds"].append(record)
        atomic_write(self.path, json.dumps(self.doc, indent=1).encode())


CHECKPOINT = "checkpoint.npz"
CHUNK_BYTES = 16 << 20  # bytes per stored chunk of the method's state


def chunk_store(path: Path) -> Path:
    """The folder holding the state chunks of the checkpoint at ``path``."""
    return path.with_name(path.name + ".chunks")


def _digest(chunk: memoryview) -> str:
    return hashlib.sha256(chunk).hexdigest()[
        :32
    ]  # 128 bits; SHA-256 has CPU instructions on most servers


def save_checkpoint(
    path: Path, server_round: int, x: NDArray[np.float32], fisher_state: bytes
) -> int:
    """Everything a resumed run needs after ``server_round``: the global vector and the method's
    state.

    The server draws no random numbers (selection is deterministic and client
    seeds derive from the run seed and the round), so no RNG state is needed.

    Parameters
    ----------
    path : Path
        The checkpoint file (``checkpoint.npz``); its chunks go to :func:`chunk_store`.
    server_round : int
        The last completed round.
    x : NDArray[float32]
        The global vector after that round.
    fisher_state : bytes
        The method's serialised state (``ServerMethod.state_bytes``).

    Returns
    -------
    int
        Bytes of state newly written (chunks already stored are not written again).
    """
    store = chunk_store(path)
    store.mkdir(parents=True, exist_ok=True)
    view = memoryview(fisher_state)
    names, written = [], 0
    for start in range(0, len(view), CHUNK_BYTES):
        chunk = view[start : start + CHUNK_BYTES]
        name = _digest(chunk)
        names.append(name)
        if not (store / name).exists():
            atomic_write(store / name, chunk, sync_dir=False)
            written += len(chunk)
    fsync_dir(store)  # every new chunk durable under its name before the checkpoint refers to it
    buf = io.BytesIO()
    np.savez(
        buf,
        round=np.array(server_round),
        x=x,
        state_size=np.array(len(view), dtype=np.int64),
        chunks=np.array(names, dtype="S32"),
    )
    atomic_write(path, buf.getvalue())
    keep = set(names)
    for f in (
        store.iterdir()
    ):  # unreferenced now that the new checkpoint is in place (or a crashed write's)
        if f.name not in keep:
            f.unlink(missing_ok=True)
    return written


#: What reading a damaged ``.npz`` raises: a truncated or garbled zip, an empty file, an unexpected
#: member.
UNREADABLE_NPZ = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile)


#: How every zip archive, hence every ``.npz``, begins.
ZIP_MAGIC = b"PK\x03\x04"


def _refuse_non_zip(path: Path) -> None:
    """Raise ``ValueError`` naming ``path`` when it is non-empty but not a zip archive.

    ``np.load`` takes a file with neither the zip nor the ``.npy`` signature for a pickle and says
    only that it "contains pickled (object) data": true of nothing here, and no hint that the file
    is damaged.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(len(ZIP_MAGIC))
    except OSError:
        return  # np.load reports it, naming the file
    if head and head != ZIP_MAGIC:
        raise ValueError(
            f"{path} is unreadable (not an .npz archive: it begins with {head!r}, not "
            f"{ZIP_MAGIC!r})"
        )


def check_checkpoint(path: Path) -> tuple[int, int]:
    """``(round, parameters)`` of the checkpoint at ``path``, once it is known to be whole enough to
    load.

    Cheap next to a resumed run: reads the round, the global vector (its CRC is checked on reading)
    and the list of chunks, and checks that every chunk is there with the bytes the checkpoint says,
    without reading the chunks (:func:`load_checkpoint` checks their hashes).

    Raises ``ValueError`` naming the file and what is wrong with it.
    """
    _refuse_non_zip(path)
    try:
        with np.load(path) as z:
            server_round, x = int(z["round"]), z["x"]
            if (
                "fisher_state" in z.files
            ):  # the earlier single-file layout: reading it checks its CRC
                _ = z["fisher_state"]
                names, size = [], None
            else:
                names, size = [n.decode() for n in z["chunks"].tolist()], int(z["state_size"])
    except UNREADABLE_NPZ as err:
        raise ValueError(f"{path} is unreadable ({type(err).__name__}: {err})") from None
    if server_round < 1 or x.ndim != 1 or not np.issubdtype(x.dtype, np.floating):
        raise ValueError(
            f"{path} is not a checkpoint of this app (round {server_round}, x {x.dtype} {x.shape})"
        )
    store = chunk_store(path)
    stored = 0
    for name in names:
        try:
            stored += (store / name).stat().st_size
        except FileNotFoundError:
            raise ValueError(f"{path}: its state chunk {name} is missing from {store}") from None
    if size is not None and stored != size:
        raise ValueError(
            f"{path}: its state chunks in {store} hold {stored} bytes, the checkpoint says {size}"
        )
    return server_round, int(x.size)


def load_checkpoint(path: Path) -> tuple[int, NDArray[np.float32], bytes]:
    """``(round, x, fisher_state_bytes)`` from :func:`save_checkpoint`.

    Raises ``ValueError`` naming the file when it is unreadable, or the chunk when one is missing or
    does not match its hash. Reads the earlier single-file layout (the state inside
    ``checkpoint.npz``) too.
    """
    _refuse_non_zip(path)
    try:
        with np.load(path) as z:
            server_round, x = int(z["round"]), z["x"].astype(np.float32)
            if "fisher_state" in z.files:
                return server_round, x, z["fisher_state"].tobytes()
            names = [n.decode() for n in z["chunks"].tolist()]
            size = int(z["state_size"])
    except UNREADABLE_NPZ as err:
        raise ValueError(f"{path} is unreadable ({type(err).__name__}: {err})") from None
    store = chunk_store(path)
    parts = []
    for name in names:
        try:
            data = (store / name).read_bytes()
        except FileNotFoundError:
            raise ValueError(f"checkpoint chunk {name} is missing from {store}") from None
        if _digest(memoryview(data)) != name:
            raise ValueError(f"checkpoint chunk {store / name} does not match its hash")
        parts.append(data)
    state = b"".join(parts)
    if len(state) != size:
        raise ValueError(f"checkpoint state is {len(state)} bytes, the checkpoint says {size}")
    return server_round, x, state


def save_model(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Save a ``state_dict`` atomically (``torch.load(path)`` reads it back)."""
    # here, not above: the launcher checks a checkpoint (check_checkpoint) without loading torch
    import torch

    buf = io.BytesIO()
    torch.save(state_dict, buf)
    atomic_write(path, buf.getvalue())
