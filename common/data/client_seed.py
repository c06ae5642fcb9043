"""A stable number per client, for the random streams a client's data or mask draws from.

Python's ``hash()`` of a string changes with every interpreter start, and a key's length is the same
for ``partition-1`` and ``partition-2``; a digest of the key's bytes is the same on every machine
and run, and different for different keys.
"""

from __future__ import annotations

import hashlib


def client_seed(key: str, bits: int = 32) -> int:
    """A non-negative integer below ``2**bits`` fixed by ``key`` (a client key, or any string).

    Parameters
    ----------
    key : str
        The client's stable key (``client-id``, ``partition-<id>``, ...).
    bits : int
        Size of the result, in bits (at most 256).
    """
    if not 0 < bits <= 256:
        raise ValueError(f"bits={bits}: expected 1 to 256")
    return int.from_bytes(hashlib.sha256(key.encode()).digest(), "big") >> (256 - bits)
