"""FedRolex: HeteroFL's width window, rolled by one channel each round so every channel gets
trained.

As the published code (AIoT-MLSys-Lab/FedRolex, ``resnet_server.py``, ``ResnetServerRoll``) computes
it:

* **window** (``width-roll``): ``split_model`` keeps in every hidden layer of ``c`` channels the
  window ``torch.roll(arange(c), t mod c)[:ceil(r c)]``, ``t`` the server's round counter (0 in the
  first round). A positive roll moves every entry ``t`` places up, so the window is the ``ceil(r
  c)`` consecutive channels from ``-t mod c``: round 1 here (``t = 0``) is HeteroFL's static slice,
  and the window moves one channel *down* each round (``down``, the default). ``up`` starts ``round
  mod c`` channels in and moves up (the reading this product used before).
* **aggregation** (``width-weighting``): ``combine`` with the default ``--weighting avg`` counts
  every holder of a hidden weight once, but weights each holder of a classifier entry or of a 1-D
  tensor by that entry's running update count (``tmp_counts``: 1 + the updates it has received), and
  because the server swaps in the count dict it increments after the first tensor, the count also
  grows with each client already added in the same round (``avg``, the default;
  :func:`common.aggregation.update_means.update_count_mean_step`). ``uniform`` counts every holder
  once, as HeteroFL. The result depends on the order clients are added; the strategy adds them in
  the order of their stable client keys, so a run repeats (the published server's order is that of
  its client list).

Everything else is HeteroFL's, with the same published defaults (its ``config.yml``: ``norm: bn``,
``scale: 1``, ``mask: 1``; ``combine`` with ``label_split``), under the same keys ``width-*``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from common.aggregation.masked import MaskedUpdate
from common.aggregation.running_sums import HolderSum, RunningSum, UpdateCountSum
from common.aggregation.update_means import update_count_mean_step
from common.methods.heterofl import HeteroFL
from common.methods.specs.fedrolex import FedRolexSpec
from common.models.layout import ParamLayout
from common.submodels.label_split import class_of_position


def count_weighted_positions(layout: ParamLayout) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """The positions FedRolex's published ``avg`` weights by update count, and which of them never
    grow.

    Those are the classifier's weight and bias and every 1-D tensor (biases, norm scales and
    shifts); a position of the layout's first tensor keeps its count from before the round (see
    :func:`common.aggregation.update_means.update_count_mean_step`).

    Parameters
    ----------
    layout : ParamLayout
        Flat layout of the full model.
    """
    counted = class_of_position(layout) >= 0
    for t, start in zip(layout.tensors, layout.offsets[:-1]):
        if len(t.shape) == 1:
            counted[start : start + t.size] = True
    positions = np.flatnonzero(counted).astype(np.int64)
    first = layout.tensors[0].size if layout.tensors else 0
    return positions, positions < first


class FedRolex(FedRolexSpec, HeteroFL):
    """Rolling-window width submodels."""

    def describe(self) -> str:
        """Method, the published elements switched on, and the window direction."""
        return f"{super().describe()} roll={self.opts.roll}"

    def roll(self, server_round: float) -> int:
        """Where the window starts (taken modulo each layer's channels).

        ``down``: ``1 - server_round``, the published window of server round ``t = server_round -
        1``; ``up``: ``server_round``.
        """
        if self.opts.roll == "up":
            return int(server_round)
        return 1 - int(server_round)

    def start_server(self, layout: ParamLayout) -> None:
        """HeteroFL's server state, and a count of 1 for every count-weighted position (published
        ``avg``)."""
        super().start_server(layout)
        self.counted, self.fixed = count_weighted_positions(layout)
        self.counts = np.ones(self.counted.size, dtype=np.int64)

    def mean_step(
        self, x: NDArray[np.float32], updates: Sequence[MaskedUpdate]
    ) -> NDArray[np.float32]:
        """``width-weighting``: the published ``avg`` (advancing the counts), or HeteroFL's holder
        mean."""
        if self.weighting != "avg":
            return super().mean_step(x, updates)
        new, self.counts = update_count_mean_step(
            x, updates, self.counted, self.counts, self.fixed, self.run.server_lr
        )
        return new

    def running_sum(self) -> RunningSum:
        """:meth:`mean_step` one reply at a time, in the order the strategy adds them (the clients'
        keys)."""
        assert self.layout is not None, "start_server() first"
        if self.weighting != "avg":
            return HolderSum(self.layout.size, self.run.server_lr)
        return UpdateCountSum(
            self.layout.size, self.counted, self.counts, self.fixed, self.run.server_lr
        )

    def sums_committed(self, sums: RunningSum) -> None:
        """``avg``: the update counts after the round."""
        if isinstance(sums, UpdateCountSum):
            self.counts = sums.running

    def state_bytes(self) -> bytes:
        """The update counts of the count-weighted positions (empty unless ``avg``)."""
        if self.weighting != "avg":
            return b""
        buf = io.BytesIO()
        np.savez(buf, counted=self.counted, counts=self.counts)
        return buf.getvalue()

    def load_state(self, data: bytes) -> None:
        """Restore :meth:`state_bytes`; ``ValueError`` when it belongs to another model."""
        if not data:
            return
        with np.load(io.BytesIO(data)) as z:
            counted, counts = z["counted"], z["counts"]
        if not np.array_equal(counted, self.counted) or counts.shape != self.counts.shape:
            raise ValueError("stored FedRolex update counts belong to another model layout")
        self.counts = counts.astype(np.int64)
