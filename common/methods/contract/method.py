"""A method's implementation: both sides of the wire in one class.

A method is three contracts: its spec (:mod:`common.methods.contract.spec`: name, run-config keys,
rules across keys; no torch), its server side (:mod:`common.methods.contract.server_side`) and its
client side (:mod:`common.methods.contract.client_side`). Each built-in method implements both
sides in one class, since they share the run's settings and the model's layout; the server and the
ClientApp each hold it by the contract of their side only.
"""

from __future__ import annotations

from common.methods.contract.client_side import ClientMethod
from common.methods.contract.server_side import ServerMethod


class Method(ServerMethod, ClientMethod):
    """Base class of every method's implementation. Subclasses add their spec and override what
    differs.

    Parameters
    ----------
    run : RunConfig
        The validated run configuration.
    """
