"""Base of the element-wise methods: a dense-shaped submodel gated by a mask, aggregated mask-aware.

Every method whose client trains the full architecture with the unheld positions zeroed (FedFIbOS,
FIARSE, HeteroFL, FedRolex, FedAvg, FedGMR) shares this wire format and these steps; a subclass
only says which positions a client holds (:meth:`MaskedMethod.mask_for`) and, where it ranks by
Fisher, keeps a :class:`~common.fisher.state.FisherState`.

* Download: the selected values and the mask's compact encoding
  (:func:`common.wire.protocol.encode_submodel`).
* Client: the mask attached with ``torch.nn.utils.prune``
  (:func:`common.training.loop.attach_masks`), the one training loop, the Fisher of the effective
  weights when the server reads it (along the local path,
  :class:`common.training.loop.EffectiveFisher`, or per example at the received weights,
  :func:`common.fisher.estimation.per_example_fisher`), reply = delta of the held values + Fisher
  payload.
* Server: :func:`common.wire.validation.validate_train_reply`, then ``x_j += eta_g * sum_n w_n M_j
  delta_j / sum_n w_n M_j`` (:func:`common.aggregation.masked.aggregate_masked`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from logging import INFO, getLogger
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.aggregation.masked import MaskedUpdate, aggregate_masked
from common.aggregation.robust import robust_mean_step
from common.aggregation.running_sums import HolderSum, RunningSum
from common.data.arrays import ArrayDataset
from common.fisher.codec import decode_fisher, encode_fisher, expected_names
from common.fisher.estimation import example_indices, per_example_fisher
from common.fisher.state import FisherState, fisher_capacity
from common.methods.contract.method import Method
from common.methods.contract.payloads import Download, FisherRequest, LocalUpdate, Received
from common.methods.round_fold import Accepted, IncrementalFold, RoundFold
from common.methods.specs.fisher import (
    FISHER_KEYS,
    MASK_GUARD_KEYS,
    FisherOptions,
    FisherRankedSpec,
    MaskGuardOptions,
)
from common.methods.specs.privacy import PRIVACY_KEYS, PrivacyOptions
from common.methods.specs.robust import ROBUST_KEYS, RobustOptions
from common.models.architectures import build_run_model, load_flat, model_layout
from common.models.layout import ParamLayout
from common.privacy.mechanism import privatise_fisher
from common.training.loop import TrainConfig, local_classes, train_masked
from common.training.personalisation import adapt
from common.wire import protocol as P
from common.wire.protocol import decode_submodel, encode_submodel
from common.wire.validation import (
    ReplyError,
    ReplyRecords,
    SentSubmodel,
    TrainReply,
    validate_train_reply,
)

if TYPE_CHECKING:
    from common.config.run import RunConfig

logger = getLogger("flwr")


def decode_received(
    received: Received, layout: ParamLayout
) -> tuple[NDArray[np.float32], NDArray[np.bool_]]:
    """The dense parameters (zero outside the mask) and the mask of a masked download."""
    if received.d != layout.size:
        raise ValueError(
            f"server model has d={received.d} but this node builds d={layout.size}: run configs "
            "differ"
        )
    arrays = received.records[P.SUBMODEL]
    return decode_submodel(arrays[P.VALUES], received.kind, arrays[P.MASK], layout.size)


def fill_outside(
    params: NDArray[np.float32], mask: NDArray[np.bool_], record: Mapping[str, NDArray]
) -> NDArray[np.float32]:
    """The full global model: the received submodel with the ``fisher-at`` values outside its mask.

    Raises ``ValueError`` when the record does not hold exactly one float32 value per position
    outside the mask.
    """
    values = np.asarray(record.get(P.VALUES, np.zeros(0, dtype=np.float32)))
    outside = int(mask.size - np.count_nonzero(mask))
    if values.dtype != np.float32 or values.shape != (outside,):
        raise ValueError(
            f"{P.FISHER_AT!r} must hold float32[{outside}] (the positions outside the mask), got "
            f"{values.dtype}{list(values.shape)}: server and node disagree on the model"
        )
    full = params.copy()
    full[~mask] = values
    return full


def fisher_cap(record: Mapping[str, NDArray]) -> int | None:
    """The most bytes the Fisher payload may take, from a ``fisher-at`` record (``None``: no cap
    sent).

    Raises ``ValueError`` unless the cap is one non-negative int64.
    """
    if P.FISHER_BYTES not in record:
        return None
    cap = np.asarray(record[P.FISHER_BYTES])
    if cap.dtype != np.int64 or cap.shape != (1,) or cap[0] < 0:
        raise ValueError(
            f"{P.FISHER_BYTES!r} must be one non-negative int64, got {cap.dtype}{list(cap.shape)}"
        )
    return int(cap[0])


class MaskedMethod(Method):
    """Element-wise submodels: everything but the choice of the mask."""

    def encode(self, x: NDArray[np.float32], mask: NDArray[np.bool_]) -> Download:
        """Selected values (float32) and the mask in its smallest encoding.

        The mask codec is :func:`common.wire.mask_codec.encode_mask`.
        """
        payload = encode_submodel(x, mask)
        return Download(
            {P.SUBMODEL: {P.VALUES: payload.values, P.MASK: payload.mask_data}},
            payload.mask_kind,
            payload.digest,
            int(payload.values.nbytes),
            int(payload.mask_data.nbytes),
        )

    def validate(
        self, reply: ReplyRecords, sent: SentSubmodel, x: NDArray[np.float32]
    ) -> TrainReply:
        """Delta of exactly the positions sent, the Fisher payload of the run's encoding (if asked),
        sane metrics."""
        assert self.layout is not None, "start_server() first"
        encoding = self.upload_encoding(self.run) if sent.fisher else "none"
        checked, payload = validate_train_reply(reply, sent, self.layout, expected_names(encoding))
        try:
            # ``masked`` scatters the inside values by the positions the update already holds
            # (increasing, from the packed mask): neither the mask nor its positions are made again.
            # Other encodings read no mask.
            fisher = decode_fisher(
                payload, None, self.layout, encoding, positions=checked.update.indices
            )
        except ValueError as err:
            raise ReplyError(f"fisher payload rejected: {err}") from err
        return replace(
            checked,
            fisher=fisher,
            fisher_bytes=sum(int(np.asarray(a).nbytes) for a in payload.values()),
        )

    def aggregate(
        self, x: NDArray[np.float32], accepted: Sequence[Accepted], server_round: int
    ) -> NDArray[np.float32]:
        """Apply :meth:`mean_step` (or the run's robust rule) to the accepted updates, then fold
        each reply into the method's state."""
        updates = [a.reply.update for a in accepted]
        robust = self.robust_rule()
        if robust is not None:
            new = robust_mean_step(
                x, updates, robust.aggregation, robust.trim, robust.clip_factor, self.run.server_lr
            )
        else:
            new = self.mean_step(x, updates)
        for a in accepted:
            self.observe(a, server_round)
        return new

    def robust_rule(self) -> RobustOptions | None:
        """The run's ``robust-*`` options when a robust rule replaces :meth:`mean_step` (``None``:
        it does not)."""
        robust: RobustOptions | None = self.run.options(ROBUST_KEYS.name)
        return robust if robust is not None and robust.active else None

    def mean_step(
        self, x: NDArray[np.float32], updates: Sequence[MaskedUpdate]
    ) -> NDArray[np.float32]:
        """Mask-aware, example-weighted mean of the deltas over the clients that held each
        position."""
        return aggregate_masked(x, updates, self.run.server_lr)

    def running_sum(self) -> RunningSum | None:
        """:meth:`mean_step` as a running sum, empty (``None``: it needs every update at once, so
        the round buffers).

        A subclass that changes :meth:`mean_step` changes this with it: the two give the same vector
        to the bit. One that changes only :meth:`mean_step` is buffered, so that its own rule is the
        one applied.
        """
        assert self.layout is not None, "start_server() first"
        if type(self).mean_step is not MaskedMethod.mean_step:
            return None
        return HolderSum(self.layout.size, self.run.server_lr)

    def sums_committed(self, sums: RunningSum) -> None:
        """A round folded into ``sums`` was committed: take what the method keeps of it (default:
        nothing)."""

    def round_fold(self, x: NDArray[np.float32], server_round: int, min_replies: int) -> RoundFold:
        """Each update into :meth:`running_sum` and freed, each reply into :meth:`observe` once the
        round counts; under a robust rule every update is kept until the round is committed (a
        median needs them all)."""
        sums = self.running_sum() if self.robust_rule() is None else None
        if sums is None:
            return super().round_fold(x, server_round, min_replies)
        return IncrementalFold(
            x, sums, lambda a: self.observe(a, server_round), min_replies, self.sums_committed
        )

    def observe(self, accepted: Accepted, fisher_round: int) -> None:
        """Fold one accepted reply into the method's state (after the model update)."""

    def warm_up(self, accepted: Sequence[Accepted], server_round: int) -> None:
        """Observe each reply's Fisher; the model is not touched."""
        for a in accepted:
            self.observe(a, server_round)

    # -------------------------------------------------------------- client side
    def _model(self, train: ArrayDataset) -> tuple[nn.Module, ParamLayout]:
        model = build_run_model(self.run, train.num_classes, train.in_channels)
        return model, model_layout(model)

    def client_train(
        self, received: Received, train: ArrayDataset, cfg: TrainConfig, device: torch.device
    ) -> LocalUpdate:
        """Train the held positions; reply with their delta and, when asked, the Fisher payload.

        With ``fisher-estimator = "global"`` the node is asked on a refresh round only: the message
        then carries the global values outside its mask, and the Fisher is measured at the full
        global model before training. With ``received`` it is measured every round at the received
        submodel, with ``path`` along local training.
        """
        model, layout = self._model(train)
        params, mask = decode_received(received, layout)
        fisher_keys = self.run.options(FISHER_KEYS.name)
        encoding, estimator = self.upload_encoding(self.run), fisher_keys.estimator
        point = None  # the weights the per-example Fisher is measured at
        max_bytes = None  # the server's cap on the Fisher payload, where it sets one
        if encoding != "none" and estimator == "global":
            if P.FISHER_AT in received.records:
                point = fill_outside(params, mask, received.records[P.FISHER_AT])
                max_bytes = fisher_cap(received.records[P.FISHER_AT])
            else:
                encoding = "none"  # not a refresh round: no Fisher in the reply
        elif encoding != "none" and estimator == "received":
            point = np.where(mask, params, 0).astype(np.float32)
        fisher, fisher_seconds = None, 0.0
        if point is not None:
            t0 = time.perf_counter()
            present = local_classes(torch.from_numpy(train.y), train.num_classes, cfg.label_mask)
            indices = example_indices(len(train), fisher_keys.examples, cfg.seed)
            whole = np.ones(layout.size, dtype=bool)
            privacy: PrivacyOptions = self.run.options(PRIVACY_KEYS.name)
            clip = privacy.fisher_clip if privacy.enabled else None
            fisher = per_example_fisher(
                model, layout, point, whole, train, indices, present, device, clip_norm=clip
            )
            if privacy.enabled:
                z = cfg.dp_noise_multiplier
                fisher = privatise_fisher(fisher, z, privacy.fisher_clip, len(indices), cfg.seed)
            fisher_seconds = time.perf_counter() - t0
        measure_path = encoding != "none" and estimator == "path"
        result = train_masked(
            model, layout, params, mask, train, cfg, device, measure_fisher=measure_path
        )
        if measure_path:
            fisher, fisher_seconds = result.fisher, result.fisher_seconds
        arrays = {P.DELTA: (result.params[mask] - params[mask]).astype(np.float32)}
        arrays.update(encode_fisher(fisher, mask, layout, encoding, max_bytes))
        seconds = result.train_seconds + (fisher_seconds if point is not None else 0.0)
        return LocalUpdate(arrays, result.num_examples, result.loss, seconds, fisher_seconds)

    def client_model(self, received: Received, train: ArrayDataset) -> nn.Module:
        """The architecture holding the received values (zero outside the mask)."""
        model, layout = self._model(train)
        params, _ = decode_received(received, layout)
        load_flat(model, layout, params)
        return model

    def client_adapt(
        self,
        received: Received,
        train: ArrayDataset,
        steps: int,
        cfg: TrainConfig,
        device: torch.device,
    ) -> nn.Module:
        """The received submodel after ``steps`` SGD steps on ``train``, its positions outside the
        mask kept at 0 (the submodel the node holds adapts; the rest of the model it never had)."""
        model, layout = self._model(train)
        params, mask = decode_received(received, layout)
        load_flat(model, layout, np.where(mask, params, 0).astype(np.float32))
        return adapt(model, train, steps, cfg, device, gate=(layout, mask))


class FisherRankedMethod(FisherRankedSpec, MaskedMethod):
    """A masked method that keeps per-client Fisher on the server (``fisher-*`` keys).

    The state is what checkpoints and ``fisher_state.npz`` hold; see :mod:`common.fisher.state`.
    """

    state_file = "fisher_state.npz"

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.fisher_keys: FisherOptions = run.options(FISHER_KEYS.name)
        self.guards: MaskGuardOptions = run.options(MASK_GUARD_KEYS.name)

    def start_server(self, layout: ParamLayout) -> None:
        """Create an empty Fisher state sized by ``fisher-memory-mb``."""
        super().start_server(layout)
        keys = self.fisher_keys
        self.fisher = FisherState(
            layout.size,
            keys.staleness_decay,
            keys.ema,
            keys.trim,
            max_clients=fisher_capacity(keys.memory_mb, layout.size, keys.precision),
            precision=keys.precision,
        )

    def describe(self) -> str:
        """Method and the Fisher settings."""
        return (
            f"method={self.name} fisher-encoding={self.upload_encoding(self.run)} "
            f"staleness-decay={self.fisher_keys.staleness_decay:.2f} "
            f"min-per-row={self.guards.min_per_row}"
        )

    def observe(self, accepted: Accepted, fisher_round: int) -> None:
        """Update the client's Fisher estimate (an all-zero upload leaves it unchanged, logged)."""
        r = accepted.reply
        if r.fisher is not None and not self.fisher.update(
            accepted.key, r.fisher, r.update.weight, fisher_round
        ):
            logger.log(
                INFO,
                "round %d: node %d sent an all-zero Fisher; its estimate is unchanged",
                fisher_round,
                accepted.node_id,
            )

    def opening_received(
        self, train: ArrayDataset, x: NDArray[np.float32], gamma: float
    ) -> Received:
        """The round-0 TRAIN download a node of capacity ``gamma`` would get, built on the node from
        the QUERY.

        The submodel of :meth:`opening_mask` and, with the ``global`` estimator, the values outside
        it, exactly as the server would encode them; :meth:`client_train` then measures the warm-up
        Fisher from it.

        Raises ``ValueError`` when ``x`` does not fit this node's model (the run configs differ).
        """
        _, layout = self._model(train)
        if x.shape != (layout.size,) or x.dtype != np.float32:
            raise ValueError(
                f"the opening model holds {x.dtype}[{x.size}], this node's model "
                f"float32[{layout.size}]"
            )
        mask = self.opening_mask(layout, x, gamma)
        download = self.encode(x, mask)
        records = dict(download.records)
        if self.fisher_keys.estimator == "global":
            records[P.FISHER_AT] = {P.VALUES: np.ascontiguousarray(x[~mask], dtype=np.float32)}
        return Received(records, download.kind, download.digest, layout.size, 0)

    def fisher_due(self, key: str, server_round: int) -> bool:
        """``global`` estimator: whether ``key`` has no estimate, or one at least ``fisher-every``
        rounds old."""
        own = self.fisher.clients.get(key)
        return own is None or server_round - own.round >= self.fisher_keys.every

    def fisher_request(
        self,
        key: str,
        server_round: int,
        x: NDArray[np.float32],
        mask: NDArray[np.bool_],
        download: Download | None = None,
    ) -> FisherRequest | None:
        """``global``: a refresh when due, carrying the global values outside the mask; otherwise
        every round."""
        if self.upload_encoding(self.run) == "none":
            return None
        if self.fisher_keys.estimator != "global":
            return FisherRequest({})
        if not self.fisher_due(key, server_round):
            return None
        return FisherRequest({P.VALUES: P.outside_values(x, mask)})

    def client_estimate(self, key: str | None, server_round: int) -> tuple[NDArray | None, str]:
        """The Fisher a mask for ``key`` is ranked by: its own (staleness-blended) estimate, else
        the prior."""
        if key is not None and key in self.fisher.clients:
            return self.fisher.estimate(key, server_round), "client"
        return self.fisher.global_prior(), "prior"

    def state_bytes(self) -> bytes:
        """The Fisher state, serialised."""
        return self.fisher.to_bytes()

    def load_state(self, data: bytes) -> None:
        """Restore the Fisher state of a checkpoint."""
        self.fisher = FisherState.from_bytes(data)
