"""The spec every method has: what selects it, the keys it owns and the rules it puts on a run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from common.config.schema import KeyGroup, Schema
from common.methods.specs.privacy import PRIVACY_KEYS, check_privacy
from common.methods.specs.robust import ROBUST_KEYS, check_robust

if TYPE_CHECKING:
    from common.config.run import RunConfig


class MethodSpec:
    """A method as the run configuration sees it. Subclasses set :attr:`name` and
    :attr:`implementation`.

    Everything here is a class attribute or a class method: a spec is never instantiated. The
    method's implementation (a :class:`common.methods.contract.method.Method`) subclasses its spec,
    so both answer alike.
    """

    #: The ``method`` run-config key that selects this method.
    name: ClassVar[str] = ""
    #: One line for the README's method table: what a capacity-``gamma`` client holds.
    summary: ClassVar[str] = ""
    #: The method's own run-config keys (``None``: it has none).
    options: ClassVar[type[Schema] | None] = None
    #: Prefix of those keys in the run config (e.g. ``gmr-``).
    options_prefix: ClassVar[str] = ""
    #: Groups of keys the method shares with others (e.g. the Fisher-ranked methods' ``fisher-*``
    #: keys).
    shared_key_groups: ClassVar[tuple[KeyGroup, ...]] = ()
    #: Settings ``fibos bench`` also runs this method with by default, each a row of its own
    #: (``key=value`` joined by ``+``; e.g. FedGMR capacity-limited beside its published bandwidth
    #: kind).
    bench_variants: ClassVar[tuple[str, ...]] = ()
    #: Where the implementation lives, ``"module:Class"``; imported only when a run builds the
    #: method.
    implementation: ClassVar[str] = ""
    #: Whether this class is the implementation itself (true for every
    #: :class:`common.methods.contract.method.Method`).
    is_implementation: ClassVar[bool] = False
    #: Whether the node's local steps can be first-order MAML steps (``meta-learning``): its
    #: training is one plain loop over the received weights, with no statistics gathered from the
    #: gradients it needs.
    meta_learning_wraps: ClassVar[bool] = True
    #: Whether a run may keep one model per cluster of nodes (``cluster-by``): the strategy then
    #: runs one instance of the method per cluster, each a copy of the first made from its
    #: checkpoint state.
    clusters: ClassVar[bool] = True

    @classmethod
    def key_groups(cls) -> tuple[KeyGroup, ...]:
        """Every group of run-config keys this method owns: its own (:attr:`options`) and shared
        ones."""
        if cls.options is None:
            return cls.shared_key_groups
        return (
            KeyGroup(cls.name, cls.options_prefix, cls.options, cls.name),
            *cls.shared_key_groups,
        )

    @classmethod
    def auto_settings(cls, run: RunConfig) -> dict[str, Any]:
        """The method's values of the common keys a run leaves at ``auto`` (by field name).

        The base values hold for most methods; a method whose published code differs overrides them.
        """
        return {"clip_grad_norm": 0.0, "label_mask": False, "server_lr": 1.0}

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """Cross-field rules of this method; raise ``ValueError`` naming the keys that conflict."""

    @classmethod
    def check_safeguards(cls, run: RunConfig) -> None:
        """Refuse ``dp-*`` and ``robust-*`` settings this method cannot honour
        (:func:`common.methods.specs.privacy.check_privacy`,
        :func:`common.methods.specs.robust.check_robust`)."""
        specs = [s for s in _subclasses(MethodSpec) if s.name]
        groups = cls.key_groups()
        covered = sorted({s.name for s in specs if PRIVACY_KEYS in s.key_groups()})
        check_privacy(run, PRIVACY_KEYS in groups, cls.reads_fisher(run), covered)
        check_robust(
            run,
            ROBUST_KEYS in groups,
            sorted({s.name for s in specs if ROBUST_KEYS in s.key_groups()}),
        )
        cls.check_clusters(run, specs)
        if run.meta_learning != "off":
            wraps = sorted(s.name for s in specs if s.meta_learning_wraps)
            if not cls.meta_learning_wraps:
                raise ValueError(
                    f"meta-learning={run.meta_learning!r} cannot wrap method={run.method!r}, whose "
                    "local training needs statistics of its gradients; it wraps: "
                    f"{', '.join(wraps)}"
                )
            if cls.reads_fisher(run) and run.options("fisher").estimator == "path":
                raise ValueError(
                    f'meta-learning={run.meta_learning!r} with fisher-estimator="path": the Fisher '
                    'would be read from meta-gradients; use fisher-estimator="global" or '
                    '"received"'
                )

    @classmethod
    def check_clusters(cls, run: RunConfig, specs: list[type[MethodSpec]]) -> None:
        """Refuse ``cluster-by`` for a method that cannot be kept per cluster, and ``fisher``
        similarity for one that reads no Fisher."""
        if run.cluster_by == "off":
            return
        if not cls.clusters:
            able = sorted(s.name for s in specs if s.clusters)
            raise ValueError(
                f"cluster-by={run.cluster_by!r} cannot keep method={run.method!r} per cluster; it "
                f"can: {', '.join(able)}"
            )
        if run.cluster_by == "fisher" and not cls.reads_fisher(run):
            raise ValueError(
                f"cluster-by='fisher' with method={run.method!r}, which reads no Fisher from its "
                'nodes; use cluster-by = "updates"'
            )

    @classmethod
    def reads_fisher(cls, run: RunConfig) -> bool:
        """Whether the server reads clients' Fisher (so clients measure and upload it)."""
        return False

    @classmethod
    def upload_encoding(cls, run: RunConfig) -> str:
        """The Fisher encoding clients upload (``fisher-encoding``): ``none`` for a run that never
        reads it."""
        return run.options("fisher").encoding if cls.reads_fisher(run) else "none"


def _subclasses(cls: type) -> set[type]:
    """Every class below ``cls`` (every spec and implementation loaded so far; the registry loads
    every spec)."""
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found
