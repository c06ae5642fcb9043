"""What an operator runs: the ``fibos`` command line, the local launcher, Control API helpers, credentials."""
