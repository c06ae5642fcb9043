"""What an operator runs: the fibos command, the local launcher, Control API, credentials."""
