"""``fedfibos-aggregation``: the participant mean (default) against the holder mean, on a
hand-computed case."""

from __future__ import annotations

import numpy as np
import pytest

from common.aggregation.masked import MaskedUpdate
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.methods import create_method
from common.methods.round_fold import Accepted
from common.models.layout import ParamLayout, TensorSpec
from common.wire.validation import TrainReply

LAYOUT = ParamLayout((TensorSpec("fc.weight", (2, 2)), TensorSpec("fc.bias", (2,))))


def _reply(
    key: str, indices: list[int], delta: list[float], weight: float, fisher: float
) -> Accepted:
    update = MaskedUpdate(np.array(indices, np.int64), np.array(delta, np.float32), weight)
    return Accepted(1, key, TrainReply(update, np.full(LAYOUT.size, fisher, np.float32), {}))


def _aggregate(aggregation: str | None) -> tuple[np.ndarray, object]:
    raw = {"method": "fedfibos"} | ({"fedfibos-aggregation": aggregation} if aggregation else {})
    method = create_method(parse_run_config(raw))
    method.start_server(LAYOUT)
    x = np.array([1.0, 2.0, 3.0, 4.0, 0.5, -0.5], np.float32)
    # "big" (30 examples) held every position; "small" (10 examples) held positions 0 and 4 only.
    replies = [
        _reply("big", [0, 1, 2, 3, 4, 5], [0.4, 0.4, -0.8, 0.0, 0.2, 0.2], 30.0, 1.0),
        _reply("small", [0, 4], [-0.4, 0.6], 10.0, 2.0),
    ]
    return method.aggregate(x, replies, 1), method


def test_holder_mean_moves_each_position_by_its_holders_mean():
    new, method = _aggregate("holders")
    # position 0: (30*0.4 + 10*-0.4)/40 = 0.2; position 1 only the big client held: its delta in
    # full.
    np.testing.assert_allclose(new, [1.2, 2.4, 2.2, 4.0, 0.5 + 0.3, -0.3], rtol=1e-6)
    assert "aggregation=holders" in method.describe()


@pytest.mark.parametrize("aggregation", [None, "participants"])  # None: the default
def test_participant_mean_damps_positions_few_clients_held(aggregation):
    new, method = _aggregate(aggregation)
    # every position divides by all 40 examples: position 1 moves by 30/40 of the big client's
    # delta.
    np.testing.assert_allclose(new, [1.2, 2.3, 2.4, 4.0, 0.5 + 0.3, -0.35], rtol=1e-6)
    assert set(method.fisher.clients) == {"big", "small"}  # both replies' Fisher observed
    assert "aggregation=participants" in method.describe()


def test_unknown_aggregation_names_the_key():
    with pytest.raises(ConfigError, match="fedfibos-aggregation"):
        parse_run_config({"method": "fedfibos", "fedfibos-aggregation": "median"})
