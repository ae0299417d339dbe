"""pagedkv conformance suite: a pytest plugin that holds any backend to the specs."""
