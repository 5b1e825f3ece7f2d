"""On-disk token shard formats: one module per format, each with its byte-level spec."""
