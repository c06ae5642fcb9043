"""The method interface: everything that differs between federated methods, on both sides of the
wire.

A method decides, for one round,

* **server side**: what it records about a node at discovery (:meth:`Method.node_joined`), which
  nodes take part (:meth:`Method.participates`), what each is sent (:meth:`Method.mask_for`,
  :meth:`Method.encode`), what a reply must carry (:meth:`Method.validate`), how accepted replies
  change the global model (:meth:`Method.round_fold`, one reply at a time, or
  :meth:`Method.aggregate`, all at once), and what it keeps between rounds
  (:meth:`Method.state_bytes`);
* **client side**: how a node turns what it received into a trained update
  (:meth:`Method.client_train`) and into a model to evaluate (:meth:`Method.client_model`);
* **configuration** (its spec, :mod:`common.methods.specs`, which the implementation subclasses):
  its own run-config keys (``options``, a pydantic model whose keys carry ``options_prefix``) and
  its cross-field rules (``check_run``).

Flower never appears here: the strategy (:mod:`server.strategy`) and the ClientApp
(:mod:`client.app`) turn these plain arrays and dicts into Messages. A method module holds one
class; its spec is registered under its ``method`` key (:data:`common.methods.BUILTIN`, or
:func:`common.methods.register`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.aggregation.asynchronous import AsyncStep
from common.aggregation.masked import MaskedUpdate
from common.methods.round_fold import Accepted, BufferedFold, RoundFold
from common.methods.specs.base import MethodSpec
from common.models.layout import ParamLayout
from common.training.personalisation import adapt
from common.wire.validation import ReplyRecords, SentSubmodel, TrainReply

if TYPE_CHECKING:
    from common.config.run import RunConfig
    from common.data.arrays import ArrayDataset
    from common.training.loop import TrainConfig


@dataclass(frozen=True)
class Download:
    """What one node is sent for one round (besides the round's config record).

    Parameters
    ----------
    records : dict[str, dict[str, NDArray]]
        Array records by record name, each a dict of named arrays.
    kind : str
        How the submodel is encoded (``mask-kind`` on the wire: ``full``, ``bits``, ``indices``,
        ``elias-fano``, ``channels``).
    digest : str
        Digest of the encoded mask, echoed by the reply.
    values_bytes : int
        Bytes of the parameter values sent.
    mask_bytes : int
        Bytes of the mask (or channel index) encoding sent.
    """

    records: dict[str, dict[str, NDArray]]
    kind: str
    digest: str
    values_bytes: int
    mask_bytes: int


@dataclass(frozen=True)
class FisherRequest:
    """Asks a node for its Fisher with this round's TRAIN message.

    Parameters
    ----------
    arrays : dict[str, NDArray]
        What the node needs besides its submodel to measure it (the ``fisher-at`` record: the global
        values outside its mask); empty: it measures on what it received.
    """

    arrays: dict[str, NDArray]


@dataclass(frozen=True)
class Received:
    """A node's view of a :class:`Download`.

    Parameters
    ----------
    records : Mapping[str, Mapping[str, NDArray]]
        The array records received.
    kind, digest : str
        ``mask-kind`` and ``mask-digest`` of the round's config record.
    d : int
        Size of the server's global model (a mismatch means the run configs differ).
    round : int
        The round (or asynchronous dispatch number) the download belongs to.
    """

    records: Mapping[str, Mapping[str, NDArray]]
    kind: str
    digest: str
    d: int
    round: int


@dataclass(frozen=True)
class LocalUpdate:
    """What local training produced, to be sent back.

    Parameters
    ----------
    arrays : dict[str, NDArray]
        The reply's update arrays (e.g. ``delta`` and the Fisher payload).
    num_examples : int
        Training examples used (the aggregation weight).
    loss : float
        Mean training loss over all steps.
    train_seconds : float
        Wall-clock seconds of local training, statistics included.
    fisher_seconds : float
        Seconds of the statistics (Fisher, curvature) accumulated inside training.
    """

    arrays: dict[str, NDArray]
    num_examples: int
    loss: float
    train_seconds: float
    fisher_seconds: float


class Method(MethodSpec):
    """Base class of every method's implementation. Subclasses add their spec and override what
    differs.

    Parameters
    ----------
    run : RunConfig
        The validated run configuration.
    """

    #: Whether this class is the implementation itself (a spec names its implementation instead).
    is_implementation = True
    #: File in the results folder that receives :meth:`state_bytes` at the end of a run (when not
    #: empty).
    state_file: ClassVar[str] = "method_state.npz"

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.layout: ParamLayout | None = None

    @property
    def asynchronous(self) -> bool:
        """Whether the run applies replies on arrival instead of in rounds (see
        :mod:`server.async_strategy`)."""
        return False

    def describe(self) -> str:
        """One log line with the settings that shape this method's behaviour."""
        return f"method={self.name}"

    def federated_model(self, model: nn.Module) -> nn.Module:
        """The model whose trainable parameters are the federated vector, built from the run's
        ``model``.

        The server builds its global model (and its evaluator) through this; the default is
        ``model`` itself. A method that federates something else (LoRA adapters on a frozen base)
        wraps it here.
        """
        return model

    # -------------------------------------------------------------- server side
    def start_server(self, layout: ParamLayout) -> None:
        """Set up the server-side state for a global model of ``layout``."""
        self.layout = layout

    def node_joined(self, key: str, info: Mapping[str, Any]) -> None:
        """A node answered discovery (default: nothing to record).

        Parameters
        ----------
        key : str
            The client's stable key.
        info : Mapping[str, Any]
            What the node reported about itself besides its capacity (the ``device`` config record:
            ``device``, ``client-key``, ``capacity-source``, and ``capacity-kind`` when its node
            config sets it).
        """

    def warm_up(self, accepted: Sequence[Accepted], server_round: int) -> None:
        """Fold the replies of a Fisher-only exchange (``fisher-warmup``: zero updates) into the
        method's state.

        The strategy passes them one at a time, in client key order, as they are validated
        (:class:`~common.methods.round_fold.WarmUpFold`).

        Parameters
        ----------
        accepted : Sequence[Accepted]
            Validated replies, in client key order.
        server_round : int
            The exchange's round (0: before the first round).
        """

    def participates(self, capacity: float) -> bool:
        """Whether a node of ``capacity`` trains (default: every node)."""
        return True

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """The held positions of a client's submodel, and the rule that chose them
        (``mask_source``).

        Parameters
        ----------
        key : str or None
            The client's stable key; ``None`` asks for the submodel of a capacity level (central
            evaluation).
        server_round : float
            The round the submodel is for (fractional round equivalents in asynchronous runs).
        gamma : float
            The client's capacity, in (0, 1].
        x : NDArray[float32]
            The current global model.
        """
        raise NotImplementedError

    def encode(self, x: NDArray[np.float32], mask: NDArray[np.bool_]) -> Download:
        """The download for ``mask`` at global values ``x``."""
        raise NotImplementedError

    def fisher_request(
        self,
        key: str,
        server_round: int,
        x: NDArray[np.float32],
        mask: NDArray[np.bool_],
        download: Download | None = None,
    ) -> FisherRequest | None:
        """Whether (and with what) a TRAIN message asks the node for its Fisher; ``None``: not this
        round.

        Called once for each TRAIN message built (a method may count the message's bytes here).
        Default: every round, on what the node received, when the method reads Fisher at all.

        Parameters
        ----------
        key : str
            The client's stable key.
        server_round : int
            The round of the TRAIN message (0: the Fisher warm-up).
        x : NDArray[float32]
            The current global model.
        mask : NDArray[bool]
            The mask the node is sent.
        download : Download, optional
            The submodel the message carries (default: ``encode(x, mask)`` where the method needs
            it).
        """
        return FisherRequest({}) if self.upload_encoding(self.run) != "none" else None

    def validate(
        self, reply: ReplyRecords, sent: SentSubmodel, x: NDArray[np.float32]
    ) -> TrainReply:
        """Check a TRAIN reply against what was ``sent`` and decode it; ``ReplyError`` says why not.

        The method owns its reply's payload: it packs it (:meth:`client_train`) and checks and
        decodes it here, so the shared layers (:mod:`common.wire`) know only what every masked reply
        carries.
        """
        raise NotImplementedError

    def aggregate(
        self, x: NDArray[np.float32], accepted: Sequence[Accepted], server_round: int
    ) -> NDArray[np.float32]:
        """The new global model from the round's accepted replies (in client key order), updating
        the method's state."""
        raise NotImplementedError

    def round_fold(self, x: NDArray[np.float32], server_round: int, min_replies: int) -> RoundFold:
        """How this round's accepted replies are folded in as they are validated
        (:mod:`common.methods.round_fold`).

        Default: :class:`~common.methods.round_fold.BufferedFold`, every reply kept until
        :meth:`aggregate` sees them all; a method whose step is a running sum folds each reply in
        and frees it.

        Parameters
        ----------
        x : NDArray[float32]
            The global model before the round (not modified: the fold returns the new one).
        server_round : int
            The round.
        min_replies : int
            Valid replies the round needs to count (``min-replies``); until then the method's state
            is untouched.
        """
        return BufferedFold(self, x, server_round)

    def state_bytes(self) -> bytes:
        """State kept between rounds, for checkpoints (empty: none)."""
        return b""

    def load_state(self, data: bytes) -> None:
        """Restore :meth:`state_bytes` from a checkpoint."""

    def prior_influence(
        self, x: NDArray[np.float32], levels: Sequence[float]
    ) -> dict[str, float] | None:
        """Certified share of a level's mask one client could flip (methods that rank by a shared
        prior)."""
        return None

    # -------------------------------------------------------------- client side
    def client_train(
        self, received: Received, train: ArrayDataset, cfg: TrainConfig, device: torch.device
    ) -> LocalUpdate:
        """Train what was received on the local split ``train``; the reply's arrays and metrics."""
        raise NotImplementedError

    def client_model(self, received: Received, train: ArrayDataset) -> nn.Module:
        """The model a node evaluates: the received submodel (``train`` gives the label space)."""
        raise NotImplementedError

    def client_adapt(
        self,
        received: Received,
        train: ArrayDataset,
        steps: int,
        cfg: TrainConfig,
        device: torch.device,
    ) -> nn.Module:
        """The received submodel after ``steps`` SGD steps on the local split ``train``
        (``adapt-steps``).

        Default: every trainable parameter of :meth:`client_model` adapts (a small model, adapters
        and head).
        """
        return adapt(self.client_model(received, train), train, steps, cfg, device)

    # ------------------------------------------------- server-side round hooks What the synchronous
    # strategy asks at fixed points of its rounds, so that it names no method's rule.
    def runs_warmup(self) -> bool:
        """Whether the run opens with round 0's Fisher warm-up, whose replies :meth:`warm_up`
        receives.

        Default: when the run asks for it (``fisher-warmup``) and this method ranks by a Fisher that
        can be measured untrained.
        """
        fisher = self.run.options("fisher")
        # The warm-up takes no step, so a `path` estimate (squared training gradients) would be
        # empty.
        return self.reads_fisher(self.run) and fisher.warmup and fisher.estimator != "path"

    def warmup_in_discovery(self) -> bool:
        """Whether a fresh run's Fisher warm-up rides on discovery instead of an exchange of its
        own.

        Then each QUERY carries the initial model and each node replies with its profile and its
        Fisher at the submodel it would be sent in round 0
        (:meth:`~common.methods.masked.FisherRankedMethod.opening_received`), which needs that
        submodel to follow from the initial model and the node's capacity alone. Default: no.
        """
        return False

    def opening_mask(
        self, layout: ParamLayout, x: NDArray[np.float32], gamma: float
    ) -> NDArray[np.bool_]:
        """The round-0 mask of a node of capacity ``gamma`` in a fresh run, from the initial model
        ``x`` alone.

        Defined by the methods whose :meth:`warmup_in_discovery` is true: the mask the server would
        choose in round 0 with no Fisher yet, computed alike on the server and on the node (the
        server checks the digest).
        """
        raise NotImplementedError(
            f"{self.name} has no opening mask: its warm-up is an exchange of its own"
        )

    def opening_received(
        self, train: ArrayDataset, x: NDArray[np.float32], gamma: float
    ) -> Received:
        """The round-0 TRAIN download a node of capacity ``gamma`` would get, built on the node from
        the initial model ``x`` of the discovery message (methods whose :meth:`warmup_in_discovery`
        is true)."""
        raise NotImplementedError(f"{self.name} does not fold its warm-up into discovery")

    def opens_round_one(self) -> bool:
        """Whether the discovery message that carries the warm-up (:meth:`warmup_in_discovery`) also
        trains round 1.

        Then each node, having measured its warm-up Fisher, builds the round-1 submodel the server
        would send it from that Fisher alone (:meth:`round_one_received`), trains it and replies
        with both: round 1 costs no exchange of its own. Needs a round-1 mask that follows from the
        node's own upload and the initial model, and a round 1 that asks for no Fisher. Default: no.
        """
        return False

    def round_one_received(
        self,
        train: ArrayDataset,
        x: NDArray[np.float32],
        gamma: float,
        opening: Received,
        warm_up: LocalUpdate,
    ) -> Received:
        """The round-1 TRAIN download a node of capacity ``gamma`` would get after its warm-up
        ``warm_up`` (measured on ``opening``, :meth:`opening_received`), built on the node
        (:meth:`opens_round_one`)."""
        raise NotImplementedError(f"{self.name} does not train round 1 with discovery")

    def participation_requirement(self) -> str:
        """What a node needs to take part (:meth:`participates`), named when no discovered node can
        (``""``: none)."""
        return ""

    def round_entries(self, x: NDArray[np.float32], levels: Sequence[float]) -> dict[str, Any]:
        """The method's own entries of a round's record, measured after aggregation, before central
        evaluation.

        Parameters
        ----------
        x : NDArray[float32]
            The global model after the round's aggregation.
        levels : Sequence[float]
            The capacity of every discovered node.

        Default: ``prior_influence``, the share of a level's mask one client could flip
        (:meth:`prior_influence`).
        """
        return {"prior_influence": self.prior_influence(x, levels)}


@runtime_checkable
class AsynchronousMethod(Protocol):
    """What a method adds to run without rounds (:mod:`server.async_strategy`), besides
    :class:`Method`."""

    def mask_at(
        self, key: str | None, t: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """The mask at ``t`` round equivalents since the start (applied updates per node)."""
        ...

    def apply_async(
        self,
        x: NDArray[np.float32],
        last_changed: NDArray[np.int64],
        version: int,
        update: MaskedUpdate,
        sent_version: int,
    ) -> AsyncStep:
        """Fold one reply into ``x`` (model ``version``) that was computed from version
        ``sent_version``."""
        ...

    def observe(self, accepted: Accepted, fisher_round: int) -> None:
        """Fold one applied reply into the method's state."""
        ...

    def eval_updates(self) -> int:
        """Applied updates between central evaluations (0: once per node)."""
        ...
