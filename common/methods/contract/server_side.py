"""The server side of a method: masks, validation, the fold of replies, and state between rounds.

The strategies (:mod:`server.strategy`, :mod:`server.async_strategy`) and the node registry hold a
method as a :class:`ServerMethod` and call only what it declares (``tests/test_architecture.py``
checks it): what the method records about a node at discovery (:meth:`ServerMethod.node_joined`),
which nodes take part (:meth:`ServerMethod.participates`), what each is sent
(:meth:`ServerMethod.mask_for`, :meth:`ServerMethod.encode`, :meth:`ServerMethod.fisher_request`),
what a reply must carry (:meth:`ServerMethod.validate`), how accepted replies change the global
model (:meth:`ServerMethod.round_fold`, one reply at a time, or :meth:`ServerMethod.aggregate`, all
at once), what it keeps between rounds (:meth:`ServerMethod.state_bytes`) and how its run opens
(:meth:`ServerMethod.opening`). Flower never appears here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from common.aggregation.asynchronous import AsyncStep
from common.aggregation.masked import MaskedUpdate
from common.methods.contract.core import MethodCore
from common.methods.contract.payloads import Download, FisherRequest
from common.methods.round_fold import Accepted, BufferedFold, RoundFold
from common.models.layout import ParamLayout
from common.wire.validation import ReplyRecords, SentSubmodel, TrainReply

if TYPE_CHECKING:
    from common.config.run import RunConfig


#: How a fresh run opens (:meth:`ServerMethod.opening`).
OpeningKind = Literal["none", "exchange", "discovery", "discovery+round-one"]


class ServerMethod(MethodCore):
    """The server's contract with a method. Implementations override what differs.

    Parameters
    ----------
    run : RunConfig
        The validated run configuration.
    """

    #: File in the results folder that receives :meth:`state_bytes` at the end of a run (when not
    #: empty).
    state_file: ClassVar[str] = "method_state.npz"
    #: What a node needs to take part (:meth:`participates`), named when no discovered node can
    #: (``""``: none).
    participation_requirement: ClassVar[str] = ""

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.layout: ParamLayout | None = None

    @property
    def asynchronous(self) -> bool:
        """Whether the run applies replies on arrival instead of in rounds (see
        :mod:`server.async_strategy`)."""
        return False

    def describe(self) -> str:
        """One log line with the settings that shape this method's behaviour."""
        return f"method={self.name}"

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

    def opening(self) -> OpeningKind:
        """How a fresh run opens, before round 1 trains (:mod:`server.opening`).

        * ``none``: round 1 is the first exchange.
        * ``exchange``: round 0 is a Fisher warm-up of its own (zero updates), whose replies
          :meth:`warm_up` receives.
        * ``discovery``: the warm-up rides on discovery. Each QUERY carries the initial model and
          each node replies with its profile and its Fisher at the submodel it would be sent in
          round 0 (:meth:`~common.methods.contract.client_side.ClientMethod.opening_received`),
          which needs that submodel to follow from the initial model and the node's capacity alone
          (:meth:`~common.methods.contract.core.MethodCore.opening_mask`).
        * ``discovery+round-one``: as ``discovery``, and the same message trains round 1: each node
          builds the round-1 submodel the server would send it from its own warm-up Fisher alone
          (:meth:`~common.methods.contract.client_side.ClientMethod.round_one_received`), trains it
          and replies with both. Needs a round-1 mask that follows from the node's own upload and
          the initial model, and a round 1 that asks for no Fisher.

        Default: ``exchange`` when the run asks for it (``fisher-warmup``) and this method ranks by
        a Fisher that can be measured untrained, else ``none``.
        """
        fisher = self.run.options("fisher")
        # The warm-up takes no step, so a `path` estimate (squared training gradients) would be
        # empty.
        if self.reads_fisher(self.run) and fisher.warmup and fisher.estimator != "path":
            return "exchange"
        return "none"

    def round_entries(self, x: NDArray[np.float32], levels: Sequence[float]) -> dict[str, Any]:
        """The method's own entries of a round's record, measured after aggregation, before central
        evaluation.

        Parameters
        ----------
        x : NDArray[float32]
            The global model after the round's aggregation.
        levels : Sequence[float]
            The capacity of every discovered node.

        Default: ``prior_influence`` (the share of a level's mask one client could flip, certified
        by methods that rank by a shared prior) is ``None``.
        """
        return {"prior_influence": None}


@runtime_checkable
class AsynchronousMethod(Protocol):
    """What a method adds to run without rounds (:mod:`server.async_strategy`), besides
    :class:`ServerMethod`."""

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
