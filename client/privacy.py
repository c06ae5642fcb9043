"""The node's side of differential privacy: its training settings, and its ledger on disk.

The local steps run DP-SGD (:func:`private_config`) and the method clips and noises the Fisher where
it measures it (:meth:`common.methods.masked.MaskedMethod.client_train`); both are charged to the
node's :class:`~common.privacy.accountant.PrivacyLedger` before the reply leaves
(:func:`charge_reply`). A reply that would take the node past ``dp-epsilon`` is not sent:
:class:`~common.privacy.accountant.BudgetSpent` becomes the node's error reply, which the server
logs as the reason it has no update from this node.

The ledger is a file in the node's cache folder, named by the node's key and the run's results
folder, so it survives a SuperNode restart and a resumed run (``resume = true``) goes on spending
the same budget; a new run (``resume = false``, a new Flower run id) starts a new ledger.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from logging import INFO
from pathlib import Path

from flwr.common.logger import log

from client.local_data import cache_dir
from common.config.node import NodeConfig
from common.config.run import RunConfig
from common.fisher.codec import expected_names
from common.methods.contract.client_side import ClientMethod
from common.methods.contract.payloads import LocalUpdate
from common.methods.specs.privacy import PRIVACY_KEYS, PrivacyOptions, node_noise_multiplier
from common.privacy.accountant import PrivacyLedger
from common.privacy.releases import Releases, node_releases
from common.training.loop import TrainConfig


def ledger_path(run: RunConfig, node: NodeConfig) -> Path:
    """Where this node keeps its ledger for this run's results folder."""
    name = hashlib.sha256(json.dumps([node.key, run.results_dir, run.seed]).encode()).hexdigest()[
        :24
    ]
    return cache_dir() / "privacy" / f"{name}.json"


def open_ledger(run: RunConfig, node: NodeConfig, run_id: int) -> PrivacyLedger:
    """The node's ledger for this run: the one on disk for the same Flower run or a resumed one,
    else a new one."""
    opts: PrivacyOptions = run.options(PRIVACY_KEYS.name)
    path = ledger_path(run, node)
    if path.exists():
        try:
            doc = json.loads(path.read_text())
            if doc.get("run_id") == run_id or run.resume:
                ledger = PrivacyLedger.from_dict(doc["ledger"])
                return replace(ledger, target_epsilon=opts.epsilon, delta=opts.delta)
        except (OSError, ValueError, KeyError, TypeError) as err:
            # A damaged ledger cannot be trusted to be low: refuse rather than start again at zero.
            raise RuntimeError(
                f"privacy ledger {path} is unreadable ({err}); the node uploads nothing"
            ) from None
    return PrivacyLedger(opts.epsilon, opts.delta)


def save_ledger(ledger: PrivacyLedger, run: RunConfig, node: NodeConfig, run_id: int) -> None:
    """Write the ledger (atomically) with the Flower run it was last charged in."""
    path = ledger_path(run, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "ledger": ledger.as_dict()}))
    tmp.replace(path)


def private_config(
    cfg: TrainConfig, method: ClientMethod, run: RunConfig, num_examples: int
) -> TrainConfig:
    """``cfg`` with DP-SGD on: the run's gradient bound and this node's noise multiplier."""
    opts: PrivacyOptions = run.options(PRIVACY_KEYS.name)
    z = node_noise_multiplier(run, method.reads_fisher(run), num_examples)
    return replace(cfg, dp_grad_clip=opts.grad_clip, dp_noise_multiplier=z)


def check_budget(ledger: PrivacyLedger, cfg: TrainConfig, num_examples: int) -> None:
    """Raise :class:`~common.privacy.accountant.BudgetSpent` before training when the round's steps
    alone would take the node past its budget: a node whose budget is spent does not train for
    nothing."""
    ledger.check(
        cfg.dp_noise_multiplier, node_releases(num_examples, cfg.batch_size, cfg.epochs, 1, 0)
    )


def reply_releases(
    update: LocalUpdate, method: ClientMethod, run: RunConfig, cfg: TrainConfig, num_examples: int
) -> Releases:
    """The mechanisms behind a reply: the DP-SGD steps of its training and its Fisher upload, if
    any."""
    encoding = method.upload_encoding(run)
    fisher = encoding != "none" and any(name in update.arrays for name in expected_names(encoding))
    return node_releases(num_examples, cfg.batch_size, cfg.epochs, 1, int(fisher))


def charge_reply(
    ledger: PrivacyLedger,
    update: LocalUpdate,
    method: ClientMethod,
    run: RunConfig,
    node: NodeConfig,
    cfg: TrainConfig,
    num_examples: int,
    run_id: int,
) -> dict[str, float]:
    """Charge a trained reply to the node's ledger before it leaves; the metrics it reports.

    Parameters
    ----------
    ledger : PrivacyLedger
        The node's ledger for this run (:func:`open_ledger`), charged and written back.
    update : LocalUpdate
        What the method trained under ``cfg`` (DP-SGD steps, a noised Fisher).
    method : ClientMethod
        The run's method.
    run, node : RunConfig, NodeConfig
        The run's and this node's settings.
    cfg : TrainConfig
        The round's training settings, DP-SGD included (:func:`private_config`).
    num_examples : int
        The node's training examples.
    run_id : int
        Flower's id of the run (a new one means a new run unless ``resume``).

    Raises :class:`~common.privacy.accountant.BudgetSpent` when the reply would go past
    ``dp-epsilon``; the ledger is then unchanged and the reply must not be sent.
    """
    opts: PrivacyOptions = run.options(PRIVACY_KEYS.name)
    releases = reply_releases(update, method, run, cfg, num_examples)
    epsilon = ledger.charge(cfg.dp_noise_multiplier, releases)
    save_ledger(ledger, run, node, run_id)
    log(
        INFO,
        "privacy: epsilon %.3f of %g spent (noise multiplier %.3f)",
        epsilon,
        opts.epsilon,
        cfg.dp_noise_multiplier,
    )
    return {"dp-epsilon": epsilon, "dp-noise-multiplier": cfg.dp_noise_multiplier}
