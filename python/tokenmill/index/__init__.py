"""Index arrays built by the C++ kernels: GPT document/sample/shuffle indices, blending, cache."""
