"""Configuration: the run and node schemas (pydantic), light enough to refuse a bad setting without torch."""
