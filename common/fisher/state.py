"""The server's knowledge of each client's diagonal Fisher.

* Per client: the last uploaded Fisher (optionally an EMA across
  participations), normalised to mean 1, and the round it was measured in.
* Global prior: the example-weighted mean of the clients' current estimates.

Normalising each upload to mean 1 makes the ranking of one client unaffected
(top-k is scale-invariant), makes the blend with the prior meaningful when
clients' loss scales differ, and keeps a client that scales its Fisher by a huge
factor from dominating the prior.

With ``trim > 0`` the prior is instead the coordinate-wise trimmed mean of the
clients' estimates (the ``trim`` share of highest and of lowest values at each
position dropped; at least one each once three clients reported), so a client
that shapes its upload adversarially cannot drag a position of the prior
outside the range the other clients span. It costs a sort over the stored
estimates when the prior is recomputed (once per round that brought uploads).

Memory stays bounded as clients grow: estimates can be stored in fp16
(``precision``; values above fp16's range are capped, which only flattens the
very top of a ranking), and at most ``max_clients`` are kept: a new client
beyond that evicts the stalest one, which then falls back to the prior (like a
client never seen) until it uploads again.

Estimates age when a client sits out rounds. The estimate used for a client at
round ``t`` is ``a * F_client + (1 - a) * F_global`` with
``a = decay ** (t - measured_round - 1)``: fully trusted the round after it was
measured, drifting toward the prior as it ages.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from common.fisher.prior_influence import sort_columns, trim_count, trimmed_mean_bounds

PRECISIONS = {"fp32": np.float32, "fp16": np.float16}
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip member timestamp of the serialised state
PRIOR_BLOCK = 1 << 20  # positions per block when computing the trimmed prior
ClientKey = int | str  # a stable client identity (the strategy uses the client key it reports)


def fisher_capacity(budget_mb: float, d: int, precision: str) -> int:
    """How many client estimates of ``d`` values fit in ``budget_mb`` MiB (at least 3, for a trimmed
    prior).

    The budget also holds the state's fixed part, 12 bytes x d: the fp32 cached prior and, while the
    per-round ``prior_influence`` record is computed, the fp32 ends of the prior's interval.
    """
    per_client = d * np.dtype(PRECISIONS[precision]).itemsize
    return max(3, int((budget_mb * 2**20 - 12 * d) // per_client))


def at_precision(estimate: NDArray[np.float32], precision: str) -> NDArray:
    """A normalised estimate as the state stores it: float32, or float16 (``fp16``) clipped to its
    largest value.

    ``estimate`` is clipped in place when ``precision`` is ``fp16``.
    """
    if precision == "fp16":
        return np.minimum(estimate, np.finfo(np.float16).max, out=estimate).astype(np.float16)
    return estimate


def _spans(d: int) -> Iterator[slice]:
    """Consecutive blocks of :data:`PRIOR_BLOCK` positions covering ``0..d-1``."""
    for start in range(0, d, PRIOR_BLOCK):
        yield slice(start, start + PRIOR_BLOCK)


def mean64(values: NDArray, buffer: NDArray[np.float64] | None = None) -> float:
    """The mean of a flat array in float64: each block of :data:`PRIOR_BLOCK` values cast to float64
    and summed pairwise (``np.add.reduce``), the block sums added in order, divided by the count.

    The summation order is this function's own (not numpy's buffer size), so the result is the same
    wherever it runs; ``nan`` for an empty array.

    Parameters
    ----------
    values : NDArray
        Flat values (any real dtype).
    buffer : NDArray[float64], optional
        Scratch space of at least ``min(len(values), PRIOR_BLOCK)`` values (allocated when not
        given).
    """
    if values.size == 0:
        return float("nan")
    wide = np.empty(min(values.size, PRIOR_BLOCK), dtype=np.float64) if buffer is None else buffer
    total = 0.0
    for span in _spans(values.size):
        w = wide[: len(values[span])]
        w[...] = values[span]
        total += float(np.add.reduce(w))
    return total / values.size


#: Positions divided (and blended) at a time by :func:`_normalised`: its buffers then stay in L2.
_SCALE_BLOCK = 1 << 16


def _normalised(
    fisher: NDArray, previous: NDArray | None = None, ema: float = 0.0
) -> NDArray[np.float32] | None:
    """:meth:`FisherState.normalise`, and with ``previous`` the EMA of :meth:`FisherState.update`
    folded in.

    The mean is :func:`mean64`'s (blocks of :data:`PRIOR_BLOCK`, which fix its summation order);
    each value is then divided by it in float64 and rounded once to float32, and, with ``previous``,
    scaled by ``1 - ema`` and added ``ema * previous``, both in float32 (``ema * old + (1 - ema) *
    new``), while its block is still in
    cache: the same operations on each value as the separate passes, so the same bits, without a
    temporary of the whole length. These element-wise passes go :data:`_SCALE_BLOCK` positions at a
    time.

    Parameters
    ----------
    fisher : NDArray
        The upload (any real dtype).
    previous : NDArray, optional
        The client's stored estimate, same length (float32 or float16).
    ema : float
        Weight of ``previous`` (used with it only).

    Returns ``None`` when the upload carries no information (its mean is not positive and finite).
    """
    flat = np.asarray(fisher).reshape(-1)
    wide = np.empty(
        min(flat.size, max(PRIOR_BLOCK, _SCALE_BLOCK)), dtype=np.float64
    )  # both passes' buffer
    mean = mean64(flat, wide)
    if not np.isfinite(mean) or mean <= 0:
        return None
    out = np.empty(flat.shape, dtype=np.float32)
    keep, share = np.float32(1 - ema), np.float32(ema)
    term = np.empty(0 if previous is None else min(flat.size, _SCALE_BLOCK), dtype=np.float32)
    for start in range(0, flat.size, _SCALE_BLOCK):
        span = slice(start, start + _SCALE_BLOCK)
        o = out[span]
        w = wide[: o.size]
        w[...] = flat[span]
        w /= mean
        o[...] = w
        if previous is not None:
            o *= keep
            o += np.multiply(previous[span], share, out=term[: o.size], dtype=np.float32)
    return out.reshape(np.shape(fisher))


@dataclass
class ClientFisher:
    """A client's current estimate.

    Parameters
    ----------
    fisher : NDArray[float32]
        Normalised flat Fisher (mean 1).
    weight : float
        The client's weight in the global prior (its example count).
    round : int
        Round in which it was last measured.
    """

    fisher: NDArray[np.float32]
    weight: float
    round: int


class FisherState:
    """Per-client Fisher estimates and the global prior.

    Parameters
    ----------
    d : int
        Flat model size.
    staleness_decay : float
        Per-round trust factor in [0, 1] for a client's own estimate as it ages.
    ema : float
        Weight of the previous estimate when a client uploads again (0 = replace).
    trim : float
        Share of clients trimmed at each end, per position, in the prior (0 = example-weighted
        mean).
    max_clients : int, optional
        Most client estimates kept in memory (None = unbounded).
    precision : {"fp32", "fp16"}
        Storage precision of the client estimates.
    """

    def __init__(
        self,
        d: int,
        staleness_decay: float = 0.7,
        ema: float = 0.0,
        trim: float = 0.0,
        max_clients: int | None = None,
        precision: str = "fp32",
    ) -> None:
        if not 0 <= trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {trim}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        if max_clients is not None and max_clients < 1:
            raise ValueError(f"max_clients must be >= 1, got {max_clients}")
        self.max_clients = max_clients
        self.precision = precision
        self.evictions = 0
        self.version = (
            0  # uploads recorded since this object was made: equal versions, equal estimates
        )
        self.d = d
        self.staleness_decay = staleness_decay
        self.ema = ema
        self.trim = trim
        self._prior: NDArray[np.float32] | None = None
        self.clients: dict[ClientKey, ClientFisher] = {}
        self._dtype = PRECISIONS[precision]
        # Each stored client keeps one row ("slot") of the serialised state while it stays: rows of
        # clients that did not upload are then byte-identical, at the same offsets, from one
        # checkpoint to the next.
        self._slots: dict[ClientKey, int] = {}

    @staticmethod
    def normalise(fisher: NDArray) -> NDArray[np.float32] | None:
        """Scale to mean 1; ``None`` when the estimate carries no information (all zero).

        The mean is taken in float64 (:func:`mean64`); each value is then divided by
        it in float64 and rounded once to float32. Both passes go one block of
        positions at a time through one float64 buffer: no float64 copy of the whole
        vector, and explicit casts instead of numpy's buffered casting loops
        (``np.mean(..., dtype=float64)``, ``np.divide(..., dtype=float64)``), which
        cost about twice as much.
        """
        return _normalised(fisher)

    @staticmethod
    def first_estimate(fisher: NDArray, precision: str) -> NDArray[np.float32] | None:
        """What :meth:`estimate` gives a client in the round after its first upload ``fisher``,
        alone.

        That estimate is the client's own (full trust), normalised and stored at ``precision``: it
        depends on no other client, so a node can compute the mask it will be ranked by (``None``:
        an all-zero upload, which is not stored, so the node is ranked by the prior).
        """
        new = FisherState.normalise(fisher)
        return None if new is None else at_precision(new, precision).astype(np.float32, copy=False)

    def update(self, client: ClientKey, fisher: NDArray, weight: float, round: int) -> bool:
        """Record a validated upload; returns ``False`` if it was uninformative (all zero)."""
        if fisher.shape != (self.d,):
            raise ValueError(f"fisher has shape {fisher.shape}, expected ({self.d},)")
        previous = self.clients.get(client)
        blend = previous.fisher if previous is not None and self.ema > 0 else None
        new = _normalised(
            fisher, blend, self.ema
        )  # the EMA with the previous estimate, if any, folded in
        if new is None:
            return False
        old = self.clients.pop(client, None)
        if old is None and self.max_clients is not None and len(self.clients) >= self.max_clients:
            stalest = min(
                self.clients, key=lambda k: self.clients[k].round
            )  # first inserted among ties
            self.clients.pop(stalest)
            self._slots[client] = self._slots.pop(
                stalest
            )  # the newcomer takes the evicted client's row
            self.evictions += 1
        self.clients[client] = ClientFisher(at_precision(new, self.precision), float(weight), round)
        self._slots.setdefault(client, len(self._slots))
        self._prior = None  # recomputed from the stored estimates when next asked for
        self.version += 1
        return True

    def memory_bytes(self) -> int:
        """Bytes held by the state's arrays (client estimates and the cached prior)."""
        cached = 0 if self._prior is None else self._prior.nbytes
        return sum(c.fisher.nbytes for c in self.clients.values()) + cached

    def global_prior(self) -> NDArray[np.float32] | None:
        """The prior (trimmed or example-weighted mean of the estimates), or ``None`` before any
        upload.

        Computed from the stored estimates when first asked for after an upload, and cached until
        the next one: the example-weighted mean sums ``w * f`` in float64 over the stored clients in
        their order, one block of positions at a time, so equal states (a restored one included)
        give equal bits.
        """
        stored = list(self.clients.values())
        total = sum(c.weight for c in stored)
        if not stored or total <= 0:
            return None
        n = len(stored)
        k = trim_count(self.trim, n)
        if self._prior is None:  # cached until the next upload changes the estimates
            prior = np.empty(self.d, dtype=np.float32)
            if k > 0:
                for span, block in self._blocks():
                    prior[span] = sort_columns(block)[k : n - k].mean(axis=0, dtype=np.float64)
            else:
                acc = np.empty(min(self.d, PRIOR_BLOCK), dtype=np.float64)
                term = np.empty_like(acc)
                for span in _spans(self.d):
                    a, t = acc[: len(prior[span])], term[: len(prior[span])]
                    np.multiply(stored[0].fisher[span], stored[0].weight, out=a, dtype=np.float64)
                    for c in stored[1:]:
                        a += np.multiply(c.fisher[span], c.weight, out=t, dtype=np.float64)
                    a /= total
                    prior[span] = np.maximum(a, 0)
            self._prior = prior
        return self._prior

    def prior_interval(self) -> tuple[NDArray[np.float32], NDArray[np.float32]] | None:
        """Per-position range of the prior over every upload any one stored client could have made.

        ``None`` when the prior is not a trimmed mean (``trim = 0`` or fewer than three
        clients): a weighted mean has no such bound, one client can move it without limit.
        See :mod:`common.fisher.prior_influence`.
        """
        k = trim_count(self.trim, len(self.clients))
        if k == 0:
            return None
        prior, lo, hi = (np.empty(self.d, dtype=np.float32) for _ in range(3))
        for span, block in self._blocks():
            prior[span], lo[span], hi[span] = trimmed_mean_bounds(block, k)
        if self._prior is None:
            self._prior = prior  # the same sort gives the prior: global_prior need not sort again
        return lo, hi

    def _blocks(self) -> Iterator[tuple[slice, NDArray]]:
        """The stored estimates stacked one block of positions at a time (bounded peak memory)."""
        stored = [c.fisher for c in self.clients.values()]
        for start in range(0, self.d, PRIOR_BLOCK):
            span = slice(start, start + PRIOR_BLOCK)
            yield span, np.stack([f[span] for f in stored])

    def estimate_interval(
        self, client: ClientKey | None, round: int
    ) -> tuple[NDArray[np.float32], NDArray[np.float32]] | None:
        """Range of :meth:`estimate` (``client=None``: of the prior) over any one *other* client's
        upload.

        A client ranked by its own fresh estimate is out of any other client's reach
        (``lo == hi``); a stale one is reached through its blend with the prior.
        """
        interval = self.prior_interval()
        own = None if client is None else self.clients.get(client)
        if own is None:
            return interval
        mine = own.fisher.astype(np.float32)
        trust = self.staleness_decay ** max(round - own.round - 1, 0)
        if trust >= 1.0:
            return mine, mine.copy()
        if interval is None:
            return None
        lo, hi = interval
        return (trust * mine + (1 - trust) * lo).astype(np.float32), (
            trust * mine + (1 - trust) * hi
        ).astype(np.float32)

    def estimate(self, client: ClientKey, round: int) -> NDArray[np.float32] | None:
        """Fisher to rank positions for ``client`` at ``round`` (``None``: nothing known yet)."""
        own = self.clients.get(client)
        if own is None:
            return self.global_prior()
        trust = self.staleness_decay ** max(round - own.round - 1, 0)
        mine = own.fisher.astype(np.float32, copy=False)
        if trust >= 1.0:
            return mine
        prior = self.global_prior()  # not None: this client's own estimate is part of it
        return (trust * mine + (1 - trust) * prior).astype(np.float32)

    def to_bytes(self, extra: Mapping[str, NDArray] | None = None) -> bytes:
        """Serialise (npz) for checkpoints and ``fisher_state.npz``.

        The estimates come first, one row per slot: a client keeps its row while
        it stays stored, so from one call to the next only the rows of clients
        that uploaded (and the small arrays after them) change, at the same byte
        offsets, which lets :mod:`server.persistence` write checkpoints
        incrementally. The prior is not stored: it is recomputed from the
        estimates, in the same order, so it resumes to the bit.

        Parameters
        ----------
        extra : Mapping[str, NDArray], optional
            More members written after the state's own (a method's other state, e.g. its held
            masks), in the same archive: appending them afterwards would copy the whole archive
            again.
        """
        ids = list(self.clients)
        by_slot = sorted(
            ids, key=self._slots.__getitem__
        )  # slots are 0..n-1: evictions hand theirs over
        arrays = {
            "slots": np.array([self._slots[i] for i in ids], dtype=np.int64),
            "d": np.array(self.d),
            "params": np.array([self.staleness_decay, self.ema, self.trim]),
            "limits": np.array(
                [-1 if self.max_clients is None else self.max_clients, self.evictions]
            ),
            "precision": np.frombuffer(self.precision.encode(), dtype=np.uint8),
            "ids": np.frombuffer(json.dumps(ids).encode(), dtype=np.uint8),
            "weights": np.array([self.clients[i].weight for i in ids], dtype=np.float64),
            "rounds": np.array([self.clients[i].round for i in ids], dtype=np.int64),
        }
        extra = dict(extra or {})
        clash = sorted(set(extra) & {*arrays, "fisher"})
        if clash:
            raise ValueError(f"extra members {clash} would overwrite the Fisher state's own")
        buf = io.BytesIO()
        # np.savez's layout, written directly: the rows streamed from the stored estimates (no
        # stacked copy) and fixed timestamps, so equal states give equal bytes.
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open(zipfile.ZipInfo("fisher.npy", _EPOCH), "w", force_zip64=True) as f:
                header = {
                    "descr": np.lib.format.dtype_to_descr(np.dtype(self._dtype)),
                    "fortran_order": False,
                }
                np.lib.format.write_array_header_1_0(f, {**header, "shape": (len(by_slot), self.d)})
                for i in by_slot:
                    f.write(
                        memoryview(np.ascontiguousarray(self.clients[i].fisher, dtype=self._dtype))
                    )
            for name, array in {**arrays, **extra}.items():
                with zf.open(zipfile.ZipInfo(f"{name}.npy", _EPOCH), "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, np.asarray(array), allow_pickle=False)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> FisherState:
        """Restore from :meth:`to_bytes` (also reads the earlier layouts: estimates in client order,
        a running sum)."""
        z = np.load(io.BytesIO(data))
        max_clients, evictions = (int(v) for v in z["limits"])
        state = cls(
            int(z["d"]),
            *(float(p) for p in z["params"]),
            max_clients=None if max_clients < 0 else max_clients,
            precision=z["precision"].tobytes().decode(),
        )
        state.evictions = evictions
        ids = json.loads(z["ids"].tobytes())
        rows = z["fisher"]
        slots = z["slots"].tolist() if "slots" in z.files else list(range(len(ids)))
        for i, slot, w, r in zip(ids, slots, z["weights"], z["rounds"]):
            f = rows[slot].copy()
            state.clients[i] = ClientFisher(f, float(w), int(r))
            state._slots[i] = int(slot)
        return state
