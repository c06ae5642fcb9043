"""Incremental checkpoints: exact round trip, only changed chunks written, a crash leaves a whole
checkpoint."""

from __future__ import annotations

import io

import numpy as np
import pytest

import server.persistence as persistence
from server.persistence import CHECKPOINT, chunk_store, load_checkpoint, save_checkpoint


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(persistence, "CHUNK_BYTES", 64)


def _state(rng, n=1000):
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def test_round_trip_is_exact(tmp_path):
    rng = np.random.default_rng(0)
    x, state = rng.standard_normal(50).astype(np.float32), _state(rng)
    written = save_checkpoint(tmp_path / CHECKPOINT, 3, x, state)
    assert written == len(state)
    done, x2, state2 = load_checkpoint(tmp_path / CHECKPOINT)
    assert done == 3 and x2.tobytes() == x.tobytes() and state2 == state


def test_only_changed_chunks_are_written_and_stale_ones_removed(tmp_path):
    rng = np.random.default_rng(1)
    path, x = tmp_path / CHECKPOINT, np.zeros(4, np.float32)
    state = bytearray(_state(rng))
    save_checkpoint(path, 1, x, bytes(state))
    state[130] ^= 0xFF  # one byte of the third chunk
    assert save_checkpoint(path, 2, x, bytes(state)) == 64
    assert load_checkpoint(path)[2] == bytes(state)
    assert len(list(chunk_store(path).iterdir())) == -(-len(state) // 64)
    assert save_checkpoint(path, 3, x, bytes(state)) == 0


def test_a_crash_before_the_new_checkpoint_leaves_the_old_one(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    path = tmp_path / CHECKPOINT
    old = _state(rng)
    save_checkpoint(path, 1, np.ones(3, np.float32), old)
    real = persistence.atomic_write

    def crash_on_the_checkpoint_file(target, data, sync_dir=True):
        if target == path:
            raise KeyboardInterrupt("killed")
        real(target, data, sync_dir)

    monkeypatch.setattr(persistence, "atomic_write", crash_on_the_checkpoint_file)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, 2, np.zeros(3, np.float32), _state(rng))
    done, x, state = load_checkpoint(path)
    assert done == 1 and state == old and x.tolist() == [1, 1, 1]


def test_missing_or_corrupt_chunk_is_named(tmp_path):
    path = tmp_path / CHECKPOINT
    save_checkpoint(path, 1, np.zeros(2, np.float32), _state(np.random.default_rng(3)))
    chunk = sorted(chunk_store(path).iterdir())[0]
    chunk.write_bytes(b"\0" + chunk.read_bytes()[1:])
    with pytest.raises(ValueError, match=chunk.name):
        load_checkpoint(path)
    chunk.unlink()
    with pytest.raises(ValueError, match="missing"):
        load_checkpoint(path)


def test_reads_the_single_file_layout(tmp_path):
    buf = io.BytesIO()
    np.savez(
        buf,
        round=np.array(4),
        x=np.arange(3, dtype=np.float32),
        fisher_state=np.frombuffer(b"abc", np.uint8),
    )
    (tmp_path / CHECKPOINT).write_bytes(buf.getvalue())
    done, x, state = load_checkpoint(tmp_path / CHECKPOINT)
    assert done == 4 and x.tolist() == [0, 1, 2] and state == b"abc"


def test_empty_state(tmp_path):
    save_checkpoint(tmp_path / CHECKPOINT, 1, np.zeros(2, np.float32), b"")
    assert load_checkpoint(tmp_path / CHECKPOINT)[2] == b""
