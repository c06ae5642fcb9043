"""Built-in and hub datasets, a node's own folder, partitions, and the local train/test split."""
