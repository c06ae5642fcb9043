"""What an operator runs: the fibos command, the local launcher, the Control API, credentials,
joining a node.

None of it travels in the FAB: the ServerApp and the ClientApp import nothing from here.
"""
