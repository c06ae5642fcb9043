"""What crosses the wire: record names, mask codecs, reply validation, SuperNode key files."""
