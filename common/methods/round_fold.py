"""How a round's accepted replies reach the global model and the method's state: one by one, or all
at once.

The strategy hands a round's validated replies to a :class:`RoundFold` one at a time, in the
clients' stable key order, and drops each after :meth:`RoundFold.add`. At the end it either commits
the round (:meth:`RoundFold.finish`: the new global vector) or, with fewer than ``min-replies``
valid replies, abandons it (:meth:`RoundFold.discard`), which must leave the global vector and the
method's state as they were.

* :class:`IncrementalFold`: the update enters a running sum (:mod:`common.aggregation.running_sums`)
  and is freed; the method's state (:meth:`~common.methods.masked.MaskedMethod.observe`: the Fisher
  estimate, FedGMR's loss record) takes each reply as soon as the round is certain to count, that is
  once ``min-replies`` valid replies have been added (the first ``min-replies - 1`` are held until
  then). Memory: the sums, plus at most ``min-replies - 1`` replies. The element-wise methods whose
  mean is a running sum use it: fedfibos, fedavg, fedavg-drop, heterofl, fedrolex, fiarse, fedgmr
  (synchronous).
* :class:`BufferedFold`: the replies are kept and
  :meth:`~common.methods.contract.server_side.ServerMethod.aggregate` sees them all at the end, as
  before: the default of :class:`~common.methods.contract.method.Method`, for methods whose step
  needs every update at once (LoRA's SVD redistribution) or that keep other per-reply state
  (CA-HFP's channel scores).
* :class:`WarmUpFold`: round 0's Fisher-only replies (``fisher-warmup``), each passed to
  :meth:`~common.methods.contract.server_side.ServerMethod.warm_up` once the round is certain to
  count; the model is not touched.

For the same replies in the same order every fold gives the batch result to the bit
(``tests/test_round_fold.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from common.aggregation.running_sums import RunningSum
from common.wire.validation import TrainReply


@dataclass(frozen=True)
class Accepted:
    """A validated TRAIN reply with the identity of the client that sent it.

    Parameters
    ----------
    node_id : int
        Flower node id of the sender.
    key : str
        The client's stable key (survives a SuperNode restart).
    reply : TrainReply
        The validated reply.
    """

    node_id: int
    key: str
    reply: TrainReply


class AggregatesRound(Protocol):
    """What :class:`BufferedFold` needs of a method:
    :meth:`~common.methods.contract.server_side.ServerMethod.aggregate`."""

    def aggregate(
        self, x: NDArray[np.float32], accepted: Sequence[Accepted], server_round: int
    ) -> NDArray[np.float32]: ...


class WarmsUp(Protocol):
    """What :class:`WarmUpFold` needs of a method:
    :meth:`~common.methods.contract.server_side.ServerMethod.warm_up`."""

    def warm_up(self, accepted: Sequence[Accepted], server_round: int) -> None: ...


class RoundFold(Protocol):
    """One round's accepted replies folded into a new global vector and the method's state."""

    #: Replies added so far.
    count: int

    def add(self, accepted: Accepted) -> None:
        """Fold one validated reply in (the caller drops it afterwards)."""
        ...

    def finish(self) -> NDArray[np.float32]:
        """Commit the round: the method's state takes every reply, and the new global vector is
        returned."""
        ...

    def discard(self) -> None:
        """Abandon the round: the global vector and the method's state stay as they were."""
        ...


class CertainAfter:
    """Replies held until the round is certain to count (``min_replies`` added), then passed on in
    order.

    Parameters
    ----------
    min_replies : int
        Valid replies the round needs (``min-replies``).
    take : Callable[[Accepted], None]
        What a reply is passed to once the round counts.
    """

    def __init__(self, min_replies: int, take: Callable[[Accepted], None]) -> None:
        self.min_replies = min_replies
        self.take = take
        self.held: list[Accepted] = []
        self.count = 0

    def add(self, accepted: Accepted) -> None:
        """Hold ``accepted`` while fewer than ``min_replies`` replies have come; else pass it (and
        the held) on."""
        self.count += 1
        self.held.append(accepted)
        if self.count >= self.min_replies:
            held, self.held = self.held, []
            for a in held:
                self.take(a)

    def discard(self) -> None:
        """Forget the held replies."""
        self.held = []


class IncrementalFold:
    """Updates into a running sum, the method's state one reply at a time (see the module
    docstring).

    Parameters
    ----------
    x : NDArray[float32]
        The global vector before the round; read, never written.
    sums : RunningSum
        The method's update mean, empty.
    observe : Callable[[Accepted], None]
        Folds one reply into the method's state.
    min_replies : int
        Valid replies the round needs (``min-replies``).
    on_finish : Callable[[RunningSum], None], optional
        Called with the sums when the round is committed (FedRolex takes its new update counts
        there).
    """

    def __init__(
        self,
        x: NDArray[np.float32],
        sums: RunningSum,
        observe: Callable[[Accepted], None],
        min_replies: int,
        on_finish: Callable[[RunningSum], None] | None = None,
    ) -> None:
        self.x = x
        self.sums = sums
        self.state = CertainAfter(min_replies, observe)
        self.on_finish = on_finish
        self.count = 0

    def add(self, accepted: Accepted) -> None:
        """The update into the sums (``ValueError`` if it does not fit: then nothing changed), then
        the state."""
        self.sums.add(accepted.reply.update)
        self.state.add(accepted)
        self.count += 1

    def finish(self) -> NDArray[np.float32]:
        """The new global vector; ``ValueError`` when fewer than ``min-replies`` replies were
        added."""
        if self.count < self.state.min_replies:
            raise ValueError(
                f"{self.count} replies, min-replies={self.state.min_replies}: discard the round"
            )
        if self.on_finish is not None:
            self.on_finish(self.sums)
        return self.sums.apply(self.x)

    def discard(self) -> None:
        """Nothing reached the method's state; the sums and the held replies are dropped."""
        self.state.discard()


class BufferedFold:
    """Every reply kept; :meth:`~common.methods.contract.server_side.ServerMethod.aggregate` sees
    them all when the round is committed.

    Parameters
    ----------
    method : AggregatesRound
        The run's method.
    x : NDArray[float32]
        The global vector before the round.
    server_round : int
        The round.
    """

    def __init__(self, method: AggregatesRound, x: NDArray[np.float32], server_round: int) -> None:
        self.method = method
        self.x = x
        self.server_round = server_round
        self.accepted: list[Accepted] = []
        self.count = 0

    def add(self, accepted: Accepted) -> None:
        """Keep the reply."""
        self.accepted.append(accepted)
        self.count += 1

    def finish(self) -> NDArray[np.float32]:
        """``method.aggregate`` over the kept replies, in the order they were added."""
        accepted, self.accepted = self.accepted, []
        return self.method.aggregate(self.x, accepted, self.server_round)

    def discard(self) -> None:
        """Drop the kept replies."""
        self.accepted = []


class WarmUpFold:
    """Round 0's replies, each passed to
    :meth:`~common.methods.contract.server_side.ServerMethod.warm_up` once the round counts.

    Parameters
    ----------
    method : WarmsUp
        The run's method.
    x : NDArray[float32]
        The global vector; returned unchanged by :meth:`finish`.
    server_round : int
        The exchange's round (0).
    min_replies : int
        Valid replies the exchange needs (``min-replies``).
    """

    def __init__(
        self, method: WarmsUp, x: NDArray[np.float32], server_round: int, min_replies: int
    ) -> None:
        self.x = x
        self.state = CertainAfter(min_replies, lambda a: method.warm_up([a], server_round))
        self.count = 0

    def add(self, accepted: Accepted) -> None:
        """Pass the reply to ``warm_up`` (held while fewer than ``min-replies`` have come)."""
        self.state.add(accepted)
        self.count += 1

    def finish(self) -> NDArray[np.float32]:
        """The global vector, unchanged."""
        return self.x

    def discard(self) -> None:
        """Drop the held replies."""
        self.state.discard()
