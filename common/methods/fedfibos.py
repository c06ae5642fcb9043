"""FedFIbOS: each client holds the top-``ceil(gamma d)`` positions of ``F_j^2 x_j^2`` under its own
Fisher.

The rule exactly minimises the masking surrogate ``sum_{j not in S} F_j^2 x_j^2`` over all masks of
the budget (:func:`common.fisher.selection.select_mask`, with the guards documented there). The
Fisher ranked by is the client's last upload blended toward the global prior as it ages; a client
that never reported is ranked by the prior; before any Fisher exists (the first round) the mask is
magnitude top-k. Masks ranked by the prior or by magnitude depend only on the capacity level: they
are computed once per level while the model and the Fisher state stay the same
(:class:`common.fisher.level_masks.LevelMasks`), for central evaluation and every such client alike.

Aggregation (``fedfibos-aggregation``): ``participants`` (default) divides each position's summed
update by every participant's examples, so a position only a few clients held moves by their share
of the round (:func:`common.aggregation.update_means.participant_mean_step`); ``holders`` moves it
by the example-weighted mean of the updates of the clients that held it
(:func:`common.aggregation.masked.aggregate_masked`). The first damps the positions that only large
clients hold, which under label skew are fitted to those clients' classes alone; it measured ahead
on the mean of the last five rounds both with 10 of 100 clients per round and with 8 clients in
every round (``docs/design/fisher.md``).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from logging import WARNING, getLogger
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from common.aggregation.masked import MaskedUpdate, aggregate_masked
from common.aggregation.running_sums import HolderSum, ParticipantSum, RunningSum
from common.aggregation.update_means import participant_mean_step
from common.fisher.codec import decode_fisher, expected_names, payload_bytes, ranked_floor
from common.fisher.held_masks import HeldMasks
from common.fisher.level_masks import LevelMasks
from common.fisher.prior_influence import contested_by_level
from common.fisher.selection import powered, select_mask
from common.fisher.state import FisherState
from common.methods.contract.payloads import Download, FisherRequest, LocalUpdate, Received
from common.methods.masked import FisherRankedMethod, decode_received
from common.methods.specs.fedfibos import FedFIbOSOptions, FedFIbOSSpec
from common.models.layout import ParamLayout
from common.wire import protocol as P
from common.wire.byte_budget import ByteLedger

if TYPE_CHECKING:
    from common.config.run import RunConfig
    from common.data.arrays import ArrayDataset
    from common.methods.contract.server_side import OpeningKind
    from common.methods.round_fold import Accepted

logger = getLogger("flwr")


class FedFIbOS(FedFIbOSSpec, FisherRankedMethod):
    """Fisher-ranked element-wise submodels (this product's method)."""

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.opts: FedFIbOSOptions = run.options(self.name)

    def describe(self) -> str:
        """Method, the Fisher settings and the aggregation."""
        return f"{super().describe()} aggregation={self.opts.aggregation}"

    def mean_step(
        self, x: NDArray[np.float32], updates: Sequence[MaskedUpdate]
    ) -> NDArray[np.float32]:
        """``fedfibos-aggregation``: the holder mean or the participant mean."""
        if self.opts.aggregation == "participants":
            return participant_mean_step(x, updates, self.run.server_lr)
        return aggregate_masked(x, updates, self.run.server_lr)

    def running_sum(self) -> RunningSum:
        """:meth:`mean_step` one reply at a time."""
        assert self.layout is not None, "start_server() first"
        if self.opts.aggregation == "participants":
            return ParticipantSum(self.layout.size, self.run.server_lr)
        return HolderSum(self.layout.size, self.run.server_lr)

    def start_server(self, layout: ParamLayout) -> None:
        """The Fisher state (see :class:`FisherRankedMethod`), an empty cache of per-level masks, no
        held masks, and with ``fedfibos-byte-budget`` an empty ledger of the clients' bytes."""
        super().start_server(layout)
        self.level_masks = LevelMasks()
        self.held = HeldMasks(layout.size)
        self.ledger = ByteLedger(self.opts.byte_budget) if self.opts.byte_budget > 0 else None
        self.fisher_caps: dict[
            str, int
        ] = {}  # client key -> the Fisher payload bytes its open refresh may take

    def state_bytes(self) -> bytes:
        """The Fisher state's npz with the held masks (``held_*``) and the byte ledger
        (``ledger_*``) after its own members (``fisher_state.npz``)."""
        extra = self.held.arrays()
        if self.ledger is not None:
            extra.update(self.ledger.arrays())
        return self.fisher.to_bytes(extra=extra)

    def load_state(self, data: bytes) -> None:
        """Restore :meth:`state_bytes` (a Fisher state without ``held_*`` members holds no masks,
        one without ``ledger_*`` members starts its ledger empty)."""
        super().load_state(data)
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            self.held = (
                HeldMasks.from_arrays(z) if "held_d" in z.files else HeldMasks(self.fisher.d)
            )
            if self.ledger is not None and "ledger_keys" in z.files:
                self.ledger = ByteLedger.from_arrays(z, self.opts.byte_budget)

    def opening(self) -> OpeningKind:
        """The base rule's warm-up, moved into discovery and, when it can, round 1 too.

        * No warm-up under ``fedfibos-byte-budget``: it sends every node the whole model before the
          server knows its capacity, which no submodel's budget covers.
        * With the ``global`` estimator the warm-up rides on discovery: round 0's mask is magnitude
          top-k (:meth:`opening_mask`), which a node can compute itself, and the warm-up already
          sends every node the whole model then, so the QUERY carrying it costs no more bytes.
        * With ``fisher-every`` >= 2 as well, discovery trains round 1: round 1 asks no Fisher, and
          a node's round-1 mask is ranked by its own fresh warm-up Fisher alone
          (:meth:`round_one_mask`), which it can compute.
        """
        kind = super().opening()
        if kind == "none" or self.opts.byte_budget != 0:
            return "none"
        if self.fisher_keys.estimator != "global":
            return kind
        return "discovery+round-one" if self.fisher_keys.every >= 2 else "discovery"

    def fisher_request(
        self,
        key: str,
        server_round: int,
        x: NDArray[np.float32],
        mask: NDArray[np.bool_],
        download: Download | None = None,
    ) -> FisherRequest | None:
        """A refresh when due (:meth:`FisherRankedMethod.fisher_request`) and, under
        ``fedfibos-byte-budget``, affordable.

        With a budget, the message's submodel is charged to the client's ledger as its share of the
        round; a refresh is then sent only when the values outside the mask fit what the client may
        still take down and a Fisher payload fits what it may still send up besides this round's
        update. The payload's cap travels with the refresh (``fisher-bytes``) and is what
        :meth:`observe` holds the reply to.
        """
        request = super().fisher_request(key, server_round, x, mask, download)
        if self.ledger is None:
            return request
        if download is None:
            download = self.encode(x, mask)
        share = download.values_bytes + download.mask_bytes
        self.ledger.charge_round(key, share)
        if request is None or not request.arrays:
            return request
        assert self.layout is not None, "start_server() first"
        k = int(np.count_nonzero(mask))
        room_down, room_up = self.ledger.room(key)
        extra = int(request.arrays[P.VALUES].nbytes)
        cap = room_up - 4 * k  # this round's update first
        encoding, d, rows = self.upload_encoding(self.run), self.layout.size, self.layout.num_rows
        # ``ranked`` fits any cap down to its floor; every other encoding has a size of its own
        need = (
            ranked_floor(d, rows) if encoding == "ranked" else payload_bytes(encoding, k, d, rows)
        )
        if extra > room_down or cap < need:
            return None
        self.ledger.charge(key, down=extra)
        self.fisher_caps[key] = cap
        return FisherRequest({**request.arrays, P.FISHER_BYTES: np.array([cap], dtype=np.int64)})

    def observe(self, accepted: Accepted, fisher_round: int) -> None:
        """Charge the reply's bytes to the client's ledger (under a budget), then fold its Fisher
        into the state.

        A Fisher payload larger than its refresh's cap is not folded in (logged): the client's
        estimate stays as it was, and the bytes it moved count against its later refreshes.
        """
        if self.ledger is None:
            super().observe(accepted, fisher_round)
            return
        r = accepted.reply
        self.ledger.charge(accepted.key, up=int(r.update.delta.nbytes) + r.fisher_bytes)
        cap = self.fisher_caps.pop(accepted.key, None)
        if r.fisher is not None and cap is not None and r.fisher_bytes > cap:
            logger.log(
                WARNING,
                "round %d: node %d sent a %d-byte Fisher where %d were allowed; its estimate is "
                "unchanged",
                fisher_round,
                accepted.node_id,
                r.fisher_bytes,
                cap,
            )
            return
        super().observe(accepted, fisher_round)

    def opening_mask(
        self, layout: ParamLayout, x: NDArray[np.float32], gamma: float
    ) -> NDArray[np.bool_]:
        """Magnitude top-``ceil(gamma d)`` under the run's guards: :meth:`mask_for` before any
        Fisher exists."""
        guards = self.guards
        return select_mask(
            layout, x, gamma, "magnitude", None, guards.min_per_row, guards.keep_vectors
        )

    def round_one_mask(
        self, layout: ParamLayout, x: NDArray[np.float32], gamma: float, fisher: NDArray[np.float32]
    ) -> NDArray[np.bool_] | None:
        """The round-1 mask of a client whose only upload is its warm-up ``fisher`` (decoded, flat).

        :meth:`mask_for` at round 1 ranks such a client by its own estimate at full trust, which is
        ``fisher`` as the state stores it (:meth:`FisherState.first_estimate`), whatever the other
        clients sent. ``None``: an all-zero upload, which leaves the client ranked by the prior.
        """
        est = FisherState.first_estimate(fisher, self.fisher_keys.precision)
        if est is None:
            return None
        guards = self.guards
        est = powered(est, self.opts.fisher_power)
        return select_mask(layout, x, gamma, "fisher", est, guards.min_per_row, guards.keep_vectors)

    def round_one_received(
        self,
        train: ArrayDataset,
        x: NDArray[np.float32],
        gamma: float,
        opening: Received,
        warm_up: LocalUpdate,
    ) -> Received:
        """The round-1 TRAIN download of :meth:`round_one_mask`, built on the node from the warm-up
        it measured.

        The Fisher is decoded from the warm-up's payload as the server decodes the reply, so the
        mask (and the digest the server checks) is the one the server computes. Raises
        ``ValueError`` for an all-zero Fisher.
        """
        _, layout = self._model(train)
        _, mask0 = decode_received(opening, layout)
        encoding = self.upload_encoding(self.run)
        payload = {name: warm_up.arrays[name] for name in expected_names(encoding)}
        fisher = decode_fisher(payload, mask0, layout, encoding)
        mask = None if fisher is None else self.round_one_mask(layout, x, gamma, fisher)
        if mask is None:
            raise ValueError(
                "the warm-up Fisher is all zero: the server ranks this node by the prior in round 1"
            )
        download = self.encode(x, mask)
        return Received(dict(download.records), download.kind, download.digest, layout.size, 1)

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """``client`` / ``prior`` Fisher ranking, or ``magnitude`` before any Fisher exists.

        A ``prior`` or ``magnitude`` mask comes from the per-level cache (read-only); a ``client``
        one is new. With the ``global`` estimator a client's mask is ``held`` until its estimate
        changes (a refresh).
        """
        own = self.fisher.clients.get(key) if key is not None else None
        hold = own is not None and self.fisher_keys.estimator == "global"
        if hold:
            held = self.held.get(key, own.round, gamma)
            if held is not None:
                return held, "held"
        est, source = self.client_estimate(key, int(server_round))
        if est is None:
            source, rule = "magnitude", "magnitude"
        else:
            rule, est = "fisher", powered(est, self.opts.fisher_power)

        def select() -> NDArray[np.bool_]:
            guards = self.guards
            return select_mask(
                self.layout, x, gamma, rule, est, guards.min_per_row, guards.keep_vectors
            )

        if source == "client":
            mask = select()
            if hold:
                self.held.put(key, own.round, gamma, mask)
            return mask, source
        # The Fisher state object and its version name the prior: a restored state is a new object.
        mask = self.level_masks.get(x, (self.fisher, self.fisher.version), gamma, select)
        if source == "prior" and key is not None and self.opts.hold_prior_masks:
            # The prior changes only when a client uploads, so the latest upload's round names it,
            # also after a resume (the held masks are part of the method's state).
            stamp = max((c.round for c in self.fisher.clients.values()), default=-1)
            held = self.held.get(key, stamp, gamma)
            if held is not None:
                return held, "held"
            self.held.put(key, stamp, gamma, mask)
        return mask, source

    def round_entries(self, x: NDArray[np.float32], levels: Sequence[float]) -> dict[str, Any]:
        """``prior_influence`` (:meth:`prior_influence`)."""
        return {"prior_influence": self.prior_influence(x, levels)}

    def prior_influence(
        self, x: NDArray[np.float32], levels: Sequence[float]
    ) -> dict[str, float] | None:
        """Per capacity level below 1: the share of a prior-ranked mask any one client could flip.

        ``None`` while the prior is a plain mean, or a trimmed mean of fewer than three clients,
        which one client can move without bound (:mod:`common.fisher.prior_influence`).
        """
        interval = self.fisher.prior_interval()
        if interval is None:
            return None
        lo, hi = (
            powered(v, self.opts.fisher_power) for v in interval
        )  # a monotone map keeps the bounds
        below = sorted((g for g in set(levels) if g < 1.0), reverse=True)
        guards = self.guards
        contested = contested_by_level(
            self.layout, x, below, lo, hi, guards.min_per_row, guards.keep_vectors
        )
        return {f"{gamma:g}": float(c.mean()) for gamma, c in zip(below, contested)}
