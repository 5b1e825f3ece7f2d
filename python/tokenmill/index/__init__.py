"""Index arrays built by the C++ kernels (GPT document/sample/shuffle indices, blending, packing
plans, mixture draws), their cache and the data fingerprints that keep the cache honest."""
