"""What bytes on disk mean: token shard formats (one module per format, each with its byte-level
spec), format detection, the tokenizer sidecar of a tokenized dataset and the BOS/EOS scan that
finds documents. Object-storage prefixes are read through ``tokenmill.storage``, the layer below.
"""
