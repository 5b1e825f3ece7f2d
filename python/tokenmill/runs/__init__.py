"""A training run's data, above the datasets: its config file (`config_file`: a YAML, TOML or
JSON file of GPTDatasetConfig fields, a tokenizer, sizes and packing) and the offline cache build
and check over it (`cache_build`: `tokenmill build-cache`).

It sits beside `tokenize` and `cli` rather than inside `datasets` because a run config may name a
tokenmill tokenizer (``tokenizer: {kind: ...}``), which only `tokenize` can load; the data layers
never import `tokenize`.
"""
