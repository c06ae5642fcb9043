"""What a round sent: the value :meth:`configure_train` returns and :meth:`aggregate_train` takes.

Flower's strategies keep no round in ``self``: ``configure_train`` returns the round's Messages and
``aggregate_train`` gets the replies. A submodel round also needs, to check and fold each reply,
what each node was sent (its mask and digest) and the model the round started from. A
:class:`TrainPlan` carries both: it is iterable over the round's Messages, as Flower's
``configure_train`` result is, and it is the second argument of the strategy's ``aggregate_train``.
:class:`EvaluatePlan` is the same for the nodes' own evaluation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Message
from numpy.typing import NDArray

from common.wire.validation import SentSubmodel
from server.strategy_core.round_records import ClientRound


@dataclass
class TrainPlan:
    """One round's TRAIN messages and what each node was sent.

    Parameters
    ----------
    server_round : int
        The round (0: the Fisher warm-up).
    x : NDArray[float32]
        The global model the round starts from: replies are checked against it and folded into a
        copy.
    messages : list[Message]
        The TRAIN messages, in the clients' key order (:meth:`take_messages` hands them to the
        grid).
    sent : dict
        Node id -> the :class:`SentSubmodel` its reply must match.
    clients : dict
        Node id -> its entry of the round record (bytes, mask, status), updated as its reply is
        folded.
    """

    server_round: int
    x: NDArray[np.float32]
    messages: list[Message] = field(default_factory=list)
    sent: dict[int, SentSubmodel] = field(default_factory=dict)
    clients: dict[int, ClientRound] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Message]:
        return iter(self.messages)

    def __len__(self) -> int:
        return len(self.messages)

    def take_messages(self) -> list[Message]:
        """The messages, no longer held here: once the grid has pushed them, their submodels can
        go."""
        messages, self.messages = self.messages, []
        return messages


@dataclass
class EvaluatePlan:
    """One evaluation round's EVALUATE messages, what each node was sent, and what the replies
    measured.

    Parameters
    ----------
    server_round : int
        The round whose model the nodes evaluate.
    messages : list[Message]
        The EVALUATE messages, one per node with a test split.
    sent : dict
        Node id -> the :class:`SentSubmodel` its reply must match.
    federated : dict, optional
        The node-measured figures per capacity, once :meth:`aggregate_evaluate` has the replies (a
        round record's ``federated``).
    """

    server_round: int
    messages: list[Message] = field(default_factory=list)
    sent: dict[int, SentSubmodel] = field(default_factory=dict)
    federated: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Message]:
        return iter(self.messages)

    def __len__(self) -> int:
        return len(self.messages)
