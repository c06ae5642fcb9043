"""A node's own data: the layouts it is read from, the label space, the one image transform, and bad
input."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from common.config.node import parse_node_config
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.catalog import parse_classes
from common.data.local_split import derive_local_data
from common.data.node_data import (
    InputSpec,
    LabelSpace,
    NodeDataError,
    image_to_input,
    read_node_data,
)
from tests.image_folders import digits_arrays, write_image_folder

DIGITS = tuple(str(i) for i in range(10))
GREY8 = InputSpec("image", 8, 1)


def _words(texts):
    """A stand-in text encoder: the length of each text's words (enough to see which text went
    where)."""
    return np.asarray(
        [[len(w) for w in t.split()[:4]] + [0] * (4 - len(t.split()[:4])) for t in texts], np.int64
    )


# ------------------------------------------------------------------ the transform and the label
# space
def test_the_image_transform_gives_the_runs_channels_and_size_as_uint8():
    rgb = Image.fromarray(np.full((20, 30, 3), (255, 0, 0), np.uint8), mode="RGB")
    grey = image_to_input(rgb, 8, 1)
    assert grey.shape == (1, 8, 8) and grey.dtype == np.uint8
    assert np.all(grey == round(0.299 * 255))  # PIL's L conversion of pure red
    colour = image_to_input(rgb, 12, 3)
    assert colour.shape == (3, 12, 12)
    assert np.all(colour[0] == 255) and np.all(colour[1:] == 0)
    same = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8), mode="L")
    assert np.array_equal(
        image_to_input(same, 8, 1)[0], np.arange(64).reshape(8, 8)
    )  # no resize at size


def test_classes_are_names_or_a_count():
    assert parse_classes("cat, dog,bird") == ("cat", "dog", "bird")
    assert parse_classes("3") == ("0", "1", "2")
    for bad, why in (
        ("1", "at least 2"),
        ("cat", "at least 2"),
        ("cat,,dog", "empty"),
        ("a,b,a", "more than once"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_classes(bad)


def test_labels_map_by_name_or_index_and_missing_ones_are_marked():
    space = LabelSpace(("cat", "dog", "bird"))
    got = space.indices(["dog", 2, None, "", float("nan"), 0.0, " bird "], "t")
    assert got.tolist() == [1, 2, -1, -1, -1, 0, 2]
    with pytest.raises(NodeDataError, match=r"\['fish'\] are not among the run's classes"):
        space.indices(["cat", "fish"], "t")
    with pytest.raises(NodeDataError, match=r"\['3'\]"):
        space.indices([3], "t")


def test_a_class_mapping_other_than_the_runs_is_refused_and_a_prefix_of_it_is_not():
    space = LabelSpace(("cat", "dog", "bird"))
    space.check_mapping(["cat", "dog"], "t")
    with pytest.raises(NodeDataError, match="'dog' is 0 here but 1 in the run"):
        space.check_mapping(["dog", "cat"], "t")


# ------------------------------------------------------------------ the layouts
def test_an_image_folder_is_read_with_the_runs_class_indices(tmp_path):
    root = write_image_folder(tmp_path / "imgs", {3: 5, 7: 4})
    data = read_node_data(root, DIGITS, GREY8)
    assert data.train.x.shape == (9, 1, 8, 8) and data.train.x.dtype == np.uint8
    assert sorted(data.train.y.tolist()) == [3] * 5 + [7] * 4
    assert data.train.num_classes == 10 and data.test is None
    assert data.report.layout == "image-folder" and data.report.held_classes == ("3", "7")
    images, labels = digits_arrays()
    first3 = np.flatnonzero(labels == 3)[0]
    assert any(
        np.array_equal(x[0], images[first3]) for x in data.train.x
    )  # pixels survive the round trip


def test_an_image_folder_with_a_readme_beside_its_classes_is_still_an_image_folder(tmp_path):
    root = write_image_folder(tmp_path / "imgs", {2: 3})
    (root / "README.txt").write_text("camera 7, spring batch\n")
    assert read_node_data(root, DIGITS, GREY8).report.layout == "image-folder"
    with pytest.raises(NodeDataError, match="holds text lines, but the run's model takes images"):
        read_node_data(root / "README.txt", DIGITS, GREY8)
    with pytest.raises(NodeDataError, match="is an image folder, but the run's model takes text"):
        read_node_data(
            write_image_folder(tmp_path / "only", {2: 1}), DIGITS, InputSpec("text", encode=_words)
        )


def test_an_image_folder_with_a_class_outside_the_run_is_refused(tmp_path):
    root = write_image_folder(tmp_path / "imgs", {1: 2})
    (root / "zebra").mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(root / "zebra" / "z.png")
    with pytest.raises(NodeDataError, match=r"\['zebra'\] are not among the run's classes"):
        read_node_data(root, DIGITS, GREY8)


def test_corrupt_images_non_images_and_empty_class_folders_are_counted_not_silent(tmp_path):
    root = write_image_folder(tmp_path / "imgs", {1: 3, 2: 3})
    (root / "1" / "broken.png").write_bytes(b"not a png at all")
    (root / "2" / "notes.txt").write_text("hello")
    (root / "5").mkdir()
    data = read_node_data(root, DIGITS, GREY8)
    assert len(data.train) == 6
    assert data.report.skipped == {"unreadable image": 1}
    text = data.report.summary()
    assert "skipped 1 (unreadable image)" in text
    assert "['5'] hold no image" in text and "1 file(s) in class folders are not images" in text


def test_a_save_to_disk_folder_with_class_label_and_its_own_test_split(tmp_path):
    import datasets

    images, labels = digits_arrays()
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=list(DIGITS))}
    )

    def part(lo, hi):
        return datasets.Dataset.from_dict(
            {
                "image": [Image.fromarray(i, mode="L") for i in images[lo:hi]],
                "label": labels[lo:hi].tolist(),
            },
            features=features,
        )

    datasets.DatasetDict({"train": part(0, 30), "test": part(30, 40)}).save_to_disk(
        str(tmp_path / "hf")
    )
    data = read_node_data(tmp_path / "hf", DIGITS, GREY8)
    assert data.report.layout == "hf-saved"
    assert len(data.train) == 30 and data.test is not None and len(data.test) == 10
    assert data.train.y.tolist() == labels[:30].tolist()
    assert np.array_equal(data.test.x[:, 0], images[30:40])


def test_a_save_to_disk_folder_whose_class_order_differs_is_refused(tmp_path):
    import datasets

    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["1", "0"])}
    )
    ds = datasets.Dataset.from_dict(
        {"image": [Image.fromarray(np.zeros((8, 8), np.uint8))] * 2, "label": [0, 1]},
        features=features,
    )
    ds.save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(NodeDataError, match="class mapping differs"):
        read_node_data(tmp_path / "hf", DIGITS, GREY8)


def test_a_csv_of_image_paths_and_label_names_skips_rows_without_a_label(tmp_path):
    images, labels = digits_arrays()
    (tmp_path / "t" / "img").mkdir(parents=True)
    rows = ["file,label"]
    for i in range(6):
        Image.fromarray(images[i], mode="L").save(tmp_path / "t" / "img" / f"{i}.png")
        rows.append(f"img/{i}.png,{labels[i] if i != 4 else ''}")
    (tmp_path / "t" / "train.csv").write_text("\n".join(rows) + "\n")
    data = read_node_data(tmp_path / "t", DIGITS, GREY8, input_column="file")
    assert data.report.layout == "table" and data.report.skipped == {"no label": 1}
    assert data.train.y.tolist() == [labels[i] for i in range(6) if i != 4]


def test_a_table_without_the_label_or_input_column_is_refused_naming_the_key(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "train.csv").write_text("text,target\nhello there,1\n")
    with pytest.raises(NodeDataError, match="no label column 'label'.*set label-column"):
        read_node_data(tmp_path / "t", ("0", "1"), InputSpec("text", encode=_words))
    data = read_node_data(
        tmp_path / "t", ("0", "1"), InputSpec("text", encode=_words), label_column="target"
    )
    assert data.train.y.tolist() == [1]
    with pytest.raises(NodeDataError, match="no image column.*set input-column"):
        read_node_data(tmp_path / "t", ("0", "1"), GREY8, label_column="target")


def test_text_lines_with_label_names_and_a_test_file(tmp_path):
    (tmp_path / "tx").mkdir()
    (tmp_path / "tx" / "train.tsv").write_text(
        "pos\tgood film\nneg\tawful\nno tab here\nneg\t   \n\npos\tfine\n"
    )
    (tmp_path / "tx" / "test.txt").write_text("neg\tbad bad\n")
    data = read_node_data(tmp_path / "tx", ("neg", "pos"), InputSpec("text", encode=_words))
    assert data.report.layout == "text-lines"
    assert (
        data.train.y.tolist() == [1, 0, 1] and data.test is not None and data.test.y.tolist() == [0]
    )
    assert data.train.x[0].tolist() == [4, 4, 0, 0]  # "good film" through the encoder
    assert data.report.skipped == {"line without label<TAB>text": 1, "empty text": 1}


@pytest.mark.parametrize(
    ("files", "why"),
    [
        (None, "no such file or folder"),
        ([], "no supported layout"),
        (["x.bin"], "no supported layout"),
    ],
)
def test_a_missing_or_unrecognised_folder_is_refused_naming_it(tmp_path, files, why):
    root = tmp_path / "node"
    if files is not None:
        root.mkdir()
        for name in files:
            (root / name).write_text("?")
    with pytest.raises(NodeDataError, match=why) as err:
        read_node_data(root, DIGITS, GREY8)
    assert str(root) in str(err.value)


def test_a_folder_of_only_unreadable_images_has_no_example(tmp_path):
    (tmp_path / "i" / "3").mkdir(parents=True)
    (tmp_path / "i" / "3" / "a.png").write_bytes(b"garbage")
    with pytest.raises(NodeDataError, match=r"no readable example.*skipped 1 \(unreadable image\)"):
        read_node_data(tmp_path / "i", DIGITS, GREY8)


# ------------------------------------------------------------------ run and node configuration
NODE_RUN = {"dataset": "node", "classes": "10", "image-size": 8, "batch-size": 8, "eval-every": 1}


def test_a_node_data_run_names_its_classes_and_needs_an_evaluation_without_a_server_test_set():
    cfg = parse_run_config(NODE_RUN)
    assert cfg.class_names == DIGITS
    with pytest.raises(ConfigError, match="classes is empty"):
        parse_run_config({"dataset": "node"})
    with pytest.raises(ConfigError, match='eval-every=0 with dataset = "node"'):
        parse_run_config({**NODE_RUN, "eval-every": 0})
    parse_run_config({**NODE_RUN, "eval-every": 0, "test-data-path": "/srv/test"})
    with pytest.raises(ConfigError, match="classes='3' is set, but dataset='digits'"):
        parse_run_config({"classes": "3"})
    with pytest.raises(ConfigError, match="classes='a,a'.*more than once"):
        parse_run_config({**NODE_RUN, "classes": "a,a"})
    with pytest.raises(ConfigError, match="image-channels"):
        parse_run_config({**NODE_RUN, "image-channels": 2})


def test_a_node_with_its_own_data_needs_no_partition_but_a_capacity():
    node = parse_node_config({"data-path": "/data", "capacity": 0.25})
    assert node.partition_id is None and node.data_path == "/data" and node.key.endswith(":/data")
    assert (
        parse_node_config({"data-path": "/d", "capacity": 1, "client-id": "cam-7"}).key == "cam-7"
    )
    with pytest.raises(ConfigError, match="missing 'capacity'"):
        parse_node_config({"data-path": "/data"}, capacity_mix="1,1/4")
    with pytest.raises(ConfigError, match="missing 'num-partitions'"):
        parse_node_config({"data-path": "/data", "partition-id": 0, "capacity": 1})
    assert parse_node_config(
        {"data-path": "/d", "partition-id": 2, "num-partitions": 4, "capacity": 1}
    ).key == ("partition-2")
    with pytest.raises(ConfigError, match="missing 'partition-id'"):
        parse_node_config({"capacity": 1})
    with pytest.raises(ConfigError, match="label-column"):
        parse_node_config(
            {"partition-id": 0, "num-partitions": 1, "capacity": 1, "label-column": "y"}
        )


def test_local_data_splits_the_nodes_folder_and_refuses_less_than_one_batch(tmp_path):
    run = parse_run_config(NODE_RUN)
    root = write_image_folder(tmp_path / "imgs", {0: 10, 1: 10})
    data = derive_local_data(run, parse_node_config({"data-path": str(root), "capacity": 1}))
    assert len(data.train) == 16 and len(data.test) == 4 and data.report is not None
    small = write_image_folder(tmp_path / "small", {0: 4})
    with pytest.raises(NodeDataError, match="fewer than one batch"):
        derive_local_data(run, parse_node_config({"data-path": str(small), "capacity": 1}))
    with pytest.raises(NodeDataError, match="has no data-path"):
        derive_local_data(
            run, parse_node_config({"partition-id": 0, "num-partitions": 1, "capacity": 1})
        )
    with pytest.raises(
        NodeDataError, match="dataset='digits' is shared by the nodes: .* needs partition-id"
    ):
        derive_local_data(
            parse_run_config({}), parse_node_config({"data-path": str(root), "capacity": 1})
        )
    # A node with both takes part in either kind of run: its partition here, its folder in a
    # node-data run.
    both = parse_node_config(
        {"data-path": str(root), "partition-id": 1, "num-partitions": 4, "capacity": 1}
    )
    assert derive_local_data(parse_run_config({}), both).report is None
    assert derive_local_data(run, both).report is not None


# ------------------------------------------------------------------ a federation on the nodes' own
# folders
def _node_folders(tmp_path):
    """Three nodes with their own class balance, and one whose folder holds a class the run does not
    have."""
    big = write_image_folder(tmp_path / "n1", {d: 20 for d in range(10)})
    skewed = write_image_folder(tmp_path / "n2", {0: 30, 1: 30, 2: 5, 3: 5}, offset=20)
    (skewed / "2" / "torn.png").write_bytes(b"\x89PNG torn")
    few = write_image_folder(tmp_path / "n3", {7: 25, 8: 25, 9: 10}, offset=50)
    alien = write_image_folder(tmp_path / "n4", {4: 20})
    (alien / "zebra").mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(alien / "zebra" / "z.png")
    return {
        11: {"data-path": str(big), "capacity": 1.0, "client-id": "camera-1"},
        12: {"data-path": str(skewed), "capacity": 0.25, "client-id": "camera-2"},
        13: {"data-path": str(few), "capacity": 0.0625, "client-id": "camera-3"},
        14: {"data-path": str(alien), "capacity": 1.0, "client-id": "camera-4"},
    }


def test_three_nodes_on_their_own_folders_train_with_no_server_test_set(tmp_path, monkeypatch):
    from tests.inprocess_grid import inprocess_federation

    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    nodes = _node_folders(tmp_path)
    run = {**NODE_RUN, "num-rounds": 2, "local-epochs": 1, "fisher-examples": 8}
    fed = inprocess_federation(run, dict.fromkeys(nodes, 1.0), node_configs=nodes)
    assert fed.evaluate_fn is None
    fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), 2, 60.0, evaluate_fn=fed.evaluate_fn
    )
    records = [r for r in fed.records if r["round"] > 0]
    assert [r["round"] for r in records] == [1, 2]
    first = records[0]
    out = {o["client_key"]: o for o in first["nodes_out"]}
    assert set(out) == {"camera-4"} and out["camera-4"]["event"] == "excluded"
    assert "['zebra'] are not among the run's classes" in out["camera-4"]["reason"]
    joined = {n["client_key"]: n for n in first["nodes_in"]}
    assert set(joined) == {"camera-1", "camera-2", "camera-3"}
    assert "skipped 1 (unreadable image)" in joined["camera-2"]["data"]
    assert (
        joined["camera-1"]["num_train"] == 160
    )  # 200 images, 20 % kept for the node's own test split
    for record in records:
        assert record["global"] == {}  # no server test set
        fed_figures = record["federated"]
        full = fed_figures["full_model"]
        assert full["nodes"] == 1 and full["num_examples"] == 40  # camera-1 holds the whole model
        assert set(fed_figures["per_capacity"]) == {"1", "0.25", "0.0625"}
        assert fed_figures["all"]["nodes"] == 3 and 0 <= fed_figures["all"]["accuracy"] <= 1
        assert {c["client_key"] for c in record["clients"]} == {"camera-1", "camera-2", "camera-3"}
    assert all(c["status"] == "ok" for c in records[-1]["clients"])


def test_a_server_test_folder_gives_central_figures_beside_the_federated_ones(
    tmp_path, monkeypatch
):
    from tests.inprocess_grid import inprocess_federation

    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    nodes = {k: v for k, v in _node_folders(tmp_path).items() if k != 14}
    test = write_image_folder(tmp_path / "server-test", {d: 5 for d in range(10)}, offset=100)
    run = {
        **NODE_RUN,
        "num-rounds": 1,
        "local-epochs": 1,
        "fisher-examples": 8,
        "test-data-path": str(test),
    }
    fed = inprocess_federation(run, dict.fromkeys(nodes, 1.0), node_configs=nodes)
    assert fed.evaluate_fn is not None
    fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), 1, 60.0, evaluate_fn=fed.evaluate_fn
    )
    last = fed.records[-1]
    assert last["round"] == 1 and 0 <= last["global"]["accuracy"] <= 1
    assert set(last["global"]["per_capacity"]) == {"1", "0.25", "0.0625"}
    assert last["federated"]["full_model"]["nodes"] == 1


# ------------------------------------------------------------------ what an operator sees
def _record(federated):
    return {
        "round": 2,
        "global": {},
        "federated": federated,
        "local": None,
        "clients": [],
        "replies": 3,
        "sent": 3,
        "round_seconds": 1.0,
    }


FEDERATED = {
    "full_model": {"accuracy": 0.75, "loss": 0.5, "num_examples": 40, "nodes": 1},
    "per_capacity": {
        "1": {"accuracy": 0.75, "loss": 0.5, "num_examples": 40, "nodes": 1},
        "0.25": {"accuracy": 0.5, "loss": 1.0, "num_examples": 20, "nodes": 2},
    },
    "all": {"accuracy": 2 / 3, "loss": 2 / 3, "num_examples": 60, "nodes": 3},
}


def test_without_a_server_test_set_the_round_line_and_summary_show_the_nodes_figures():
    from cli.run_report import summary_table
    from server.federated_evaluation import global_figures
    from server.strategy_core.round_records import progress_line

    line = progress_line(_record(FEDERATED), 3)
    assert (
        "[round 2/3] on nodes: global acc 0.7500 loss 0.5000 | per capacity 1:0.750 0.25:0.500"
        in line
    )
    assert global_figures(_record(FEDERATED))["source"] == "nodes' test splits"
    table = summary_table({"rounds": [{**_record(FEDERATED), "server_seconds": 0.1}]})
    assert "final global accuracy (full model, nodes' test splits): 0.7500" in table
    assert "submodel at capacity    0.25: accuracy 0.5000 (2 nodes)" in table
    no_full = {**FEDERATED, "full_model": None}
    assert "not measured (no node holds all of it" in summary_table(
        {"rounds": [{**_record(no_full), "server_seconds": 0}]}
    )


def test_federated_figures_pool_by_examples_per_level_and_for_the_full_model():
    from server.federated_evaluation import NodeEvaluation, federated_figures

    figures = federated_figures(
        [
            NodeEvaluation(1.0, True, 30, 0.3, 0.9),
            NodeEvaluation(0.25, False, 10, 1.0, 0.5),
            NodeEvaluation(0.25, False, 30, 2.0, 0.1),
        ]
    )
    assert figures["full_model"] == {"accuracy": 0.9, "loss": 0.3, "num_examples": 30, "nodes": 1}
    assert list(figures["per_capacity"]) == ["1", "0.25"]
    assert figures["per_capacity"]["0.25"]["accuracy"] == pytest.approx((0.5 * 10 + 0.1 * 30) / 40)
    assert figures["all"]["loss"] == pytest.approx((0.3 * 30 + 10 + 60) / 70)
    assert federated_figures([NodeEvaluation(0.5, False, 5, 1.0, 0.2)])["full_model"] is None


def test_fibos_local_gives_each_supernode_its_folder_and_refuses_a_mismatch_before_starting(
    tmp_path, no_process
):
    from cli.launcher import LocalFederation, main

    a, b = write_image_folder(tmp_path / "a", {0: 1}), write_image_folder(tmp_path / "b", {1: 1})
    fed = LocalFederation([1.0, 0.25], tmp_path / "run", data_paths=[str(a), str(b)])
    assert fed.node_config(1) == f'data-path="{b}" client-id="node-1" capacity=0.25'
    node_run = ["-c", 'dataset="node"', "-c", "classes=10", "--results", str(tmp_path / "r")]
    assert (
        main(["--capacities", "1,1/4", "--data-paths", f"{a},{tmp_path / 'absent'}", *node_run])
        == 2
    )
    assert main(["--capacities", "1,1/4", *node_run]) == 2
    assert (
        main(
            ["--capacities", "1,1/4", "--data-paths", f"{a},{b}", "--results", str(tmp_path / "r")]
        )
        == 2
    )
    with pytest.raises(SystemExit):
        main(["--capacities", "1", "--data-paths", f"{a},{b}", *node_run])


def test_client_seeds_are_stable_and_tell_keys_apart():
    from common.data.client_seed import client_seed

    assert client_seed("partition-1") == client_seed("partition-1") != client_seed("partition-2")
    assert 0 <= client_seed("x", bits=8) < 256
    assert client_seed("camera-7") == int.from_bytes(
        __import__("hashlib").sha256(b"camera-7").digest()[:4], "big"
    )
    with pytest.raises(ValueError, match="bits=0"):
        client_seed("x", bits=0)
