"""Fisher machinery: per-example estimates, uplink codecs, the server's state, top-k ranking."""
