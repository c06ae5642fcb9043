"""stock-fedavg: the ClientApp, as Flower's template writes it (train the received model, send it
back)."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from stock_fedavg.task import load_data, net, product_settings, train

app = ClientApp()


@app.train()
def train_model(msg: Message, context: Context) -> Message:
    """Train the received global model on this node's partition; reply with the weights and the
    metrics.

    Besides the template's loss and example count, the reply carries what the benchmark's emulated
    fleet time
    needs: the CPU seconds of local training, the bytes received and sent, and the node's capacity.
    """
    run = product_settings(context.run_config)
    received = msg.content["arrays"]
    trainset, _ = load_data(run, context.node_config)
    model = net(run, trainset.num_classes, trainset.in_channels)
    model.load_state_dict(received.to_torch_state_dict())
    config = msg.content["config"]
    server_round = int(config["server-round"])
    loss, cpu_seconds = train(
        model,
        trainset,
        int(context.run_config["local-epochs"]),
        float(config["lr"]),
        float(context.run_config["momentum"]),
        int(context.run_config["batch-size"]),
        seed=run.seed * 1_000_003 + server_round * 1009 + int(context.node_config["partition-id"]),
    )
    arrays = ArrayRecord(model.state_dict())
    metrics = MetricRecord(
        {
            "train-loss": loss,
            "num-examples": len(trainset),
            "cpu-seconds": cpu_seconds,
            "bytes-down": sum(a.numpy().nbytes for a in received.values()),
            "bytes-up": sum(a.numpy().nbytes for a in arrays.values()),
            "capacity": float(context.node_config.get("capacity", 1.0)),
        }
    )
    return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)
