"""Benchmark: the bytes a node would upload if its masked update went through Flower's SecAgg+.

Secure aggregation hides each node's update inside the sum: the server learns only the total.
Flower's SecAgg+ (``flwr.serverapp``'s ``SecAggPlusWorkflow`` with the ``secaggplus_mod`` on each
node) masks every node's arrays with pseudo-random vectors that cancel in the sum, so every node
must send arrays of the same shapes. A masked update holds a different set of positions per node, so
it has to be sent dense: zeros outside the node's mask, and, for the mask-aware mean, a second dense
vector of the positions it holds (the per-position holder counts are a sum too). This benchmark
measures what that costs, with Flower's own functions, for one node at each capacity:

* ``masked update``: what the node uploads today, the ``delta`` of its ``k`` held values as a Flower
  ``Array``;
* ``keys``: SecAgg+'s stage 0 and 1, the node's two public keys and one encrypted pair of Shamir
  shares per neighbour (``flwr.common.secure_aggregation``: ``create_shares``, ``encrypt``);
* ``masked vectors``: stage 2, the quantised, masked, reduced dense vectors as ``secaggplus_mod``
  serialises them (``quantize``, ``factor_combine``, ``pseudo_rand_gen``, ``parameters_mod``,
  ``ndarray_to_bytes``): the update and the holder counts.

The same code sums the nodes' masked vectors and removes the masks, as the server would with the
shares it collects, and checks that the result is the sum of the dense updates (:func:`secure_sum`).
The Fisher upload cannot go through it at all: the server ranks each node's mask by that node's own
Fisher, not by the sum.

Usage::

    fibos bench-secagg --model cnn-bn --capacities 1,1/4,1/16,1/64 --nodes 10 --out results/secagg

Writes ``secagg.json`` and ``secagg.csv`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common import ndarray_to_bytes
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt, generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_combine,
    factor_extract,
    parameters_addition,
    parameters_mod,
    parameters_multiply,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_utils import (
    pseudo_rand_gen,
    share_keys_plaintext_concat,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)
from numpy.typing import NDArray

from benchmarks.bench_rows import write_rows
from cli.launcher import parse_capacities
from common.models.architectures import build_model, model_layout
from common.wire import protocol as P


@dataclass(frozen=True)
class SecAggSettings:
    """SecAgg+'s parameters, Flower's defaults (``SecAggPlusWorkflow``).

    Parameters
    ----------
    clipping_range : float
        Values are clipped to ``[-clipping_range, clipping_range]`` before quantisation.
    quantization_range : int
        Each value becomes an integer in ``[0, quantization_range)``.
    modulus_range : int
        The masked sum is reduced modulo this.
    max_weight : float
        The largest example count a node reports (the weight is quantised alongside).
    """

    clipping_range: float = 8.0
    quantization_range: int = 1 << 22
    modulus_range: int = 1 << 32
    max_weight: float = 1000.0


@dataclass
class SecAggNode:
    """One node's SecAgg+ keys and its private-mask seed (stages 0 and 1)."""

    node_id: int
    sk1: bytes
    pk1: bytes
    sk2: bytes
    pk2: bytes
    seed: bytes


def make_node(node_id: int, rng: np.random.Generator) -> SecAggNode:
    """A node's two key pairs (pairwise masks, share encryption) and a 32-byte private-mask seed."""
    (sk1, pk1), (sk2, pk2) = generate_key_pairs(), generate_key_pairs()
    return SecAggNode(
        node_id,
        private_key_to_bytes(sk1),
        public_key_to_bytes(pk1),
        private_key_to_bytes(sk2),
        public_key_to_bytes(pk2),
        rng.bytes(32),
    )


def key_bytes(node: SecAggNode, peers: Sequence[SecAggNode], threshold: int) -> int:
    """Bytes ``node`` uploads in stages 0 and 1: its public keys, and one ciphertext of its Shamir
    shares (of the mask seed and of its first private key) per peer, as ``secaggplus_mod`` makes
    them."""
    seed_shares = create_shares(node.seed, threshold, len(peers) + 1)
    key_shares = create_shares(node.sk1, threshold, len(peers) + 1)
    total = len(node.pk1) + len(node.pk2)
    for i, peer in enumerate(peers):
        shared = generate_shared_key(bytes_to_private_key(node.sk2), bytes_to_public_key(peer.pk2))
        plaintext = share_keys_plaintext_concat(
            node.node_id, peer.node_id, seed_shares[i], key_shares[i]
        )
        total += (
            len(encrypt(shared, plaintext)) + 16
        )  # the ciphertext, its source and destination ids
    return total


def masked_vectors(
    node: SecAggNode,
    peers: Sequence[SecAggNode],
    arrays: list[NDArray[np.float32]],
    num_examples: int,
    s: SecAggSettings,
) -> list[NDArray[np.int64]]:
    """Stage 2 of ``secaggplus_mod``: ``arrays`` weighted, quantised, masked by the private seed and
    every pairwise key, reduced modulo ``s.modulus_range``."""
    q_ratio = round(num_examples / s.max_weight * s.quantization_range)
    weighted = parameters_multiply(arrays, q_ratio / s.quantization_range)
    vectors = factor_combine(q_ratio, quantize(weighted, s.clipping_range, s.quantization_range))
    shapes = [a.shape for a in vectors]
    vectors = parameters_addition(vectors, pseudo_rand_gen(node.seed, s.modulus_range, shapes))
    for peer in peers:
        shared = generate_shared_key(bytes_to_private_key(node.sk1), bytes_to_public_key(peer.pk1))
        pairwise = pseudo_rand_gen(shared, s.modulus_range, shapes)
        combine = parameters_addition if node.node_id > peer.node_id else parameters_subtraction
        vectors = combine(vectors, pairwise)
    return parameters_mod(vectors, s.modulus_range)


def secure_sum(
    nodes: Sequence[SecAggNode], uploads: Sequence[list[NDArray[np.int64]]], s: SecAggSettings
) -> list[NDArray[np.float64]]:
    """What the server recovers from every node's stage-2 upload, as ``SecAggPlusWorkflow`` computes
    it: the sum, the private masks removed (from the seeds the shares reconstruct; the pairwise
    masks cancel), the weight factor extracted, dequantised, the clipping offsets removed: the
    example-weighted mean of the nodes' arrays."""
    shapes = [a.shape for a in uploads[0]]
    total = uploads[0]
    for upload in uploads[1:]:
        total = parameters_addition(total, upload)
    for node in nodes:
        total = parameters_subtraction(total, pseudo_rand_gen(node.seed, s.modulus_range, shapes))
    q_total, values = factor_extract(parameters_mod(total, s.modulus_range))
    mean = dequantize(values, s.clipping_range, s.quantization_range)
    offset = -(len(nodes) - 1) * s.clipping_range
    return [(v + offset) * (s.quantization_range / q_total) for v in mean]


@dataclass(frozen=True)
class UploadBytes:
    """One node's upload per round, today and through SecAgg+, in bytes.

    Parameters
    ----------
    capacity : float
        The node's capacity.
    kept, d : int
        Values the node holds, and the model's size.
    masked_update : int
        Today's update: the ``delta`` of its held values as a Flower ``Array``.
    secagg_keys : int
        SecAgg+ stages 0 and 1: public keys and one encrypted pair of shares per peer.
    secagg_update, secagg_counts : int
        SecAgg+ stage 2: the dense masked update and the dense masked holder counts.
    secagg_total : int
        All of the SecAgg+ upload.
    ratio : float
        ``secagg_total / masked_update``.
    """

    capacity: float
    kept: int
    d: int
    masked_update: int
    secagg_keys: int
    secagg_update: int
    secagg_counts: int
    secagg_total: int
    ratio: float


def upload_bytes(d: int, capacity: float, nodes: int, s: SecAggSettings, seed: int) -> UploadBytes:
    """Measure one node's upload at ``capacity`` among ``nodes`` (its peers: every other node)."""
    rng = np.random.default_rng(seed)
    np.random.seed(seed)  # SecAgg+'s stochastic rounding draws from numpy's global generator
    kept = max(1, math.ceil(capacity * d))
    mask = np.zeros(d, dtype=bool)
    mask[rng.choice(d, kept, replace=False)] = True
    delta = (rng.standard_normal(kept) * 1e-2).astype(np.float32)
    today = ArrayRecord({P.DELTA: Array(delta)}).count_bytes()
    group = [make_node(i + 1, rng) for i in range(nodes)]
    me, peers = group[0], group[1:]
    dense = np.zeros(d, dtype=np.float32)
    dense[mask] = delta
    update = masked_vectors(me, peers, [dense], 100, s)
    counts = masked_vectors(me, peers, [mask.astype(np.float32)], 100, s)
    keys = key_bytes(me, peers, threshold=nodes // 2 + 1)
    update_bytes = sum(len(ndarray_to_bytes(a)) for a in update)
    counts_bytes = sum(len(ndarray_to_bytes(a)) for a in counts)
    total = keys + update_bytes + counts_bytes
    return UploadBytes(
        capacity, kept, d, today, keys, update_bytes, counts_bytes, total, total / today
    )


def table(rows: Sequence[UploadBytes]) -> str:
    """Markdown table of the measured uploads."""
    lines = [
        "| capacity | kept values | masked update (today) | SecAgg+ keys and shares | SecAgg+ "
        "update | SecAgg+ holder counts | SecAgg+ total | x today |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.capacity:g} | {r.kept:,} of {r.d:,} | {r.masked_update / 1024:.1f} KiB "
            f"| {r.secagg_keys / 1024:.1f} KiB | {r.secagg_update / 1024:.1f} KiB "
            f"| {r.secagg_counts / 1024:.1f} KiB | {r.secagg_total / 1024:.1f} KiB | {r.ratio:.1f} "
            "|"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``fibos bench-secagg``: one node's upload per capacity, today and through SecAgg+."""
    ap = argparse.ArgumentParser(prog="fibos bench-secagg", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="cnn-bn", help="model whose size d the vectors have (digits input)"
    )
    ap.add_argument("--capacities", default="1,1/4,1/16,1/64", help="capacities to measure")
    ap.add_argument(
        "--nodes", type=int, default=10, help="nodes in the SecAgg+ group (the node and its peers)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="folder for secagg.json and secagg.csv")
    args = ap.parse_args(argv)
    if args.nodes < 2:
        ap.error("--nodes must be at least 2: SecAgg+ masks a node's vector with its peers'")
    d = model_layout(build_model(args.model, 10, 1, args.seed)).size
    settings = SecAggSettings()
    rows = [
        upload_bytes(d, c, args.nodes, settings, args.seed)
        for c in parse_capacities(args.capacities)
    ]
    print(
        f"{args.model}: d = {d:,} parameters, {args.nodes} nodes per SecAgg+ group (Flower's "
        "default ranges)"
    )
    print(table(rows))
    if args.out is not None:
        write_rows(rows, args.out, "secagg")
    return 0
