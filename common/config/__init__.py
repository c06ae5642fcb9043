"""The run and node settings (pydantic schemas), checked without loading torch or the methods."""
