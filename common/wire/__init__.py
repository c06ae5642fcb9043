"""What crosses the wire: Message record names, mask codecs, reply validation, and SuperNode key files."""
