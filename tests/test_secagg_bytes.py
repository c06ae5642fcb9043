"""What a masked update costs through Flower's SecAgg+: measured with Flower's own functions, and
the masked dense vectors really sum to the nodes' weighted mean."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.privacy.secagg_bytes import (
    SecAggSettings,
    main,
    make_node,
    masked_vectors,
    secure_sum,
    upload_bytes,
)

S = SecAggSettings()


def test_the_masked_dense_vectors_sum_to_the_weighted_mean_of_the_updates():
    rng = np.random.default_rng(3)
    np.random.seed(3)
    nodes = [make_node(i + 1, rng) for i in range(4)]
    d = 64
    masks = [rng.random(d) < share for share in (1.0, 0.25, 0.25, 1 / 16)]
    dense = [np.where(m, rng.standard_normal(d) * 0.1, 0).astype(np.float32) for m in masks]
    examples = [500, 100, 200, 50]
    uploads = [
        masked_vectors(n, [p for p in nodes if p is not n], [v], e, S)
        for n, v, e in zip(nodes, dense, examples)
    ]
    assert all(
        u[1].dtype == np.int64 and u[1].shape == (d,) for u in uploads
    )  # dense, whatever the mask
    (got,) = secure_sum(nodes, uploads, S)
    want = sum(v.astype(np.float64) * e for v, e in zip(dense, examples)) / sum(examples)
    step = 2 * S.clipping_range / S.quantization_range  # one quantisation step per node
    np.testing.assert_allclose(got, want, atol=len(nodes) * step)
    # a single upload alone reveals nothing like the node's vector
    assert not np.allclose(uploads[1][1] / S.quantization_range, dense[1], atol=0.1)


def test_through_secagg_a_small_node_uploads_its_whole_model_twice():
    d = 20_000
    rows = [upload_bytes(d, c, 10, S, 0) for c in (1.0, 1 / 4, 1 / 64)]
    for r in rows:
        assert r.kept == int(np.ceil(r.capacity * d))
        assert r.masked_update >= 4 * r.kept  # float32 values
        assert (
            r.secagg_update >= 8 * d and r.secagg_counts >= 8 * d
        )  # int64 per position, mask or not
        assert r.secagg_keys > 0
    assert [r.secagg_update for r in rows] == [
        rows[0].secagg_update
    ] * 3  # no saving below capacity 1
    assert rows[0].ratio < rows[1].ratio < rows[2].ratio and rows[2].ratio > 64


def test_the_command_prints_and_writes_the_table(tmp_path, capsys):
    assert (
        main(["--model", "cnn", "--capacities", "1,1/16", "--nodes", "3", "--out", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out
    assert "SecAgg+ total" in out and "| 0.0625 |" in out
    rows = json.loads((tmp_path / "secagg.json").read_text())
    assert [r["capacity"] for r in rows] == [1.0, 0.0625] and (tmp_path / "secagg.csv").exists()


def test_a_group_of_one_is_refused():
    with pytest.raises(SystemExit):
        main(["--nodes", "1"])
