"""stock-fedavg: Flower's FedAvg on the product's model and data (benchmark baseline)."""
