"""Map-style and iterable datasets (the Megatron-compatible API lives here)."""
