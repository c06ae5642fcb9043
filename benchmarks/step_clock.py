"""Seconds of named steps of the product's own calls, timed where the product makes them.

The server benchmark does not call the steps of a round itself: it lets the strategy run the round
and replaces a few bound methods of the strategy's objects (the method's ``mask_for``, ``validate``,
...) by wrappers that time each call under a step's name (:meth:`StepClock.wrap`, :class:`Patches`).
A call made inside another timed call counts for its own step only: each step's seconds are its
spans' own, so the steps add up to the time spent in them, never more. The plainest numpy code for a
step's arithmetic (its *anchor*) can run beside the product's call (:meth:`StepClock.anchor`); its
seconds are kept apart, taken off the enclosing span and summed in :attr:`StepClock.aside`, so that
what the strategy's own clock measured can be split into the steps, the anchors run inside it, and
the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class Span:
    """One timed call while it runs.

    Parameters
    ----------
    key : str or None
        Its step (``None``: its seconds count for no step, e.g. work beside the round).
    per_client : bool
        Whether its seconds are work done once per client (the per-client constant); may be set
        while it runs.
    absorbs : bool
        Calls made inside it count as its own (they open no span of their own).
    wall, cpu : float
        ``perf_counter`` and ``process_time`` when it began (seconds).
    inner_wall, inner_cpu : float
        Seconds spent in spans and anchors opened inside it (taken off its own).
    counted : bool
        False for a call inside an absorbing span: it is timed as that span's, not as its own.
    """

    key: str | None
    per_client: bool = True
    absorbs: bool = False
    wall: float = 0.0
    cpu: float = 0.0
    inner_wall: float = 0.0
    inner_cpu: float = 0.0
    counted: bool = True


class StepClock:
    """Wall-clock and CPU seconds per step name, each span's own (see the module docstring).

    ``project`` and ``cpu``: seconds per step (wall clock; CPU of this process, every thread).
    ``anchors``: the anchors' wall-clock seconds per step. ``per_client``: ``[wall, cpu]`` of the
    spans marked per client. ``aside``: ``[wall, cpu]`` of every anchor, wherever it ran.
    """

    def __init__(self) -> None:
        self.project: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.anchors: dict[str, float] = {}
        self.per_client = [0.0, 0.0]
        self.aside = [0.0, 0.0]
        self._open: list[Span] = []

    @contextmanager
    def step(
        self,
        key: str | None,
        per_client: bool = True,
        absorbs: bool = False,
    ) -> Iterator[Span]:
        """Time the block as a span of step ``key``; yields the span.

        The span's ``counted`` is false inside an absorbing span, whose own seconds the block's are.

        Parameters
        ----------
        key : str or None
            The step (``None``: the block's seconds count for no step and are taken off the
            enclosing span).
        per_client : bool
            Whether the block is work done once per client.
        absorbs : bool
            Whether calls made inside the block count as the block's own.
        """
        if self._open and self._open[-1].absorbs:
            yield Span(key, counted=False)
            return
        span = Span(key, per_client, absorbs, time.perf_counter(), time.process_time())
        self._open.append(span)
        try:
            yield span
        finally:
            self._open.pop()
            self._close(span, time.perf_counter() - span.wall, time.process_time() - span.cpu)

    def paused(self) -> AbstractContextManager[Span]:
        """A block whose seconds, and those of every call made inside it, count for no step.

        For work beside the round: the previous round's evaluation while this round's nodes train.
        """
        return self.step(None, per_client=False, absorbs=True)

    def _close(self, span: Span, wall: float, cpu: float) -> None:
        """Credit a finished span's own seconds to its step, and its whole seconds to its parent."""
        own_wall, own_cpu = wall - span.inner_wall, cpu - span.inner_cpu
        if span.key is not None:
            self.project[span.key] = self.project.get(span.key, 0.0) + own_wall
            self.cpu[span.key] = self.cpu.get(span.key, 0.0) + own_cpu
            if span.per_client:
                self.per_client[0] += own_wall
                self.per_client[1] += own_cpu
        self._taken(wall, cpu)

    def _taken(self, wall: float, cpu: float) -> None:
        """Seconds spent inside the innermost open span on something not its own."""
        if self._open:
            self._open[-1].inner_wall += wall
            self._open[-1].inner_cpu += cpu

    def anchor(self, key: str, fn: Callable[[], object]) -> None:
        """Run step ``key``'s anchor ``fn()``, its seconds kept apart from the span it runs in.

        They go to ``anchors[key]`` (wall clock) and :attr:`aside` (wall clock and CPU).
        """
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        self.anchors[key] = self.anchors.get(key, 0.0) + wall
        self.aside[0] += wall
        self.aside[1] += cpu
        self._taken(wall, cpu)

    def wrap(
        self,
        fn: Callable[..., Any],
        key: str,
        per_client: bool = True,
        absorbs: bool = False,
        beside: Callable[..., object] | None = None,
    ) -> Callable[..., Any]:
        """``fn`` with each call timed as a span of step ``key``.

        Parameters
        ----------
        fn : Callable
            The product's call (a bound method).
        key : str
            Its step.
        per_client : bool
            Whether a call is work done once per client.
        absorbs : bool
            Whether calls made inside it count as its own.
        beside : Callable, optional
            ``beside(result, *args, **kwargs)``: the step's anchor for this call, run after it (its
            seconds kept apart, :meth:`anchor`).
        """

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.step(key, per_client, absorbs) as span:
                out = fn(*args, **kwargs)
                if beside is not None and span.counted:
                    self.anchor(key, lambda: beside(out, *args, **kwargs))
            return out

        return timed

    def totals(self) -> tuple[float, float, float, float]:
        """``(step wall, step CPU, anchor wall, anchor CPU)`` seconds so far, all steps together."""
        return sum(self.project.values()), sum(self.cpu.values()), self.aside[0], self.aside[1]


class Patches:
    """Attributes set on objects for a while (bound methods replaced by timed ones), then undone."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, bool, Any]] = []

    def set(self, obj: object, name: str, value: Any) -> None:
        """Set ``obj.name`` to ``value`` until :meth:`undo`.

        Parameters
        ----------
        obj : object
            The instance (its class is not touched).
        name : str
            The attribute.
        value : Any
            What it is for a while.
        """
        own = name in vars(obj)
        self._undo.append((obj, name, own, vars(obj).get(name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        """Restore every attribute, last set first (one that was not on the instance is removed)."""
        while self._undo:
            obj, name, own, old = self._undo.pop()
            if own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
