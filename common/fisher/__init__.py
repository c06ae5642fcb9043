"""The Fisher machinery: per-example estimates, their uplink codecs, the server's state, and the top-k ranking."""
