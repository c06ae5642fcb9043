"""The one place a run's federation is built: its method, initial global model, central evaluation
and strategy.

:mod:`server.app` builds its run through :func:`build_federation`, and so does the in-process test
harness (``tests/inprocess_grid.py``), so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.common.logger import log
from numpy.typing import NDArray

from common.config.run import RunConfig
from common.data.datasets import load_server_data
from common.methods import create_method
from common.methods.contract.server_side import ServerMethod
from common.models.architectures import build_run_model, model_layout, trainable_arrays
from common.models.layout import ParamLayout
from common.training.evaluation import CentralEvaluator
from server.async_strategy import AsyncSubmodelStrategy
from server.clustering.strategy import ClusteredStrategy
from server.strategy import SubmodelStrategy
from server.strategy_core.base import EvaluateFn


@dataclass
class Federation:
    """A run's server side, ready to ``strategy.start``.

    Parameters
    ----------
    cfg : RunConfig
        The validated run configuration.
    method : ServerMethod
        The run's method (the strategy's own).
    strategy : SubmodelStrategy, ClusteredStrategy or AsyncSubmodelStrategy
        Rounds, or every reply applied on arrival when the method runs asynchronously.
    x0 : NDArray[float32]
        The initial global model, flat (in ``strategy.layout``).
    evaluate_fn : EvaluateFn or None
        Central evaluation on the server's test set; ``None`` when the server holds none.
    """

    cfg: RunConfig
    method: ServerMethod
    strategy: SubmodelStrategy | AsyncSubmodelStrategy
    x0: NDArray[np.float32]
    evaluate_fn: EvaluateFn | None


def central_evaluate_fn(evaluator: CentralEvaluator) -> EvaluateFn:
    """Flower's ``evaluate_fn`` over the server's test set: accuracy and loss of the arrays
    given."""

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        flat = evaluator.layout.flatten({name: arr.numpy() for name, arr in arrays.items()})
        loss, acc = evaluator(flat)
        return MetricRecord({"accuracy": acc, "loss": loss})

    return evaluate_fn


def global_model(
    cfg: RunConfig, method: ServerMethod, device: str
) -> tuple[NDArray[np.float32], ParamLayout, EvaluateFn | None]:
    """The run's initial global model (flat), its layout, and central evaluation on the server's
    test set.

    The evaluation is ``None`` when the server holds no test set (the nodes' own data without
    ``test-data-path``): the run's global figures then come from the nodes' evaluation rounds.
    ``device`` is where the evaluation runs (a torch device name).
    """
    data = load_server_data(cfg)
    model = method.federated_model(build_run_model(cfg, data.num_classes, data.in_channels))
    layout = model_layout(model)
    x0 = layout.flatten(trainable_arrays(model))
    if data.test is None:
        log(
            INFO,
            "no server test set: the global figures come from the nodes' evaluation (eval-every)",
        )
        return x0, layout, None
    evaluator = CentralEvaluator(
        method.federated_model(build_run_model(cfg, data.num_classes, data.in_channels)),
        layout,
        data.test,
        device,
    )
    return x0, layout, central_evaluate_fn(evaluator)


def build_federation(
    cfg: RunConfig, device: str, on_round: Callable[[dict[str, Any]], None] | None = None
) -> Federation:
    """The run's method, initial model, central evaluation and strategy.

    Parameters
    ----------
    cfg : RunConfig
        The validated run configuration.
    device : str
        Where central evaluation runs (a torch device name: ``cpu``, ``cuda``).
    on_round : Callable, optional
        Receives each round's record (a JSON-ready dict; settable later as ``strategy.on_round``).
    """
    method = create_method(cfg)
    x0, layout, evaluate_fn = global_model(cfg, method, device)
    strategy_class: type[SubmodelStrategy] | type[AsyncSubmodelStrategy] = SubmodelStrategy
    if method.asynchronous:
        strategy_class = AsyncSubmodelStrategy
    elif cfg.cluster_by != "off":
        strategy_class = ClusteredStrategy
    return Federation(cfg, method, strategy_class(cfg, layout, method, on_round), x0, evaluate_fn)
