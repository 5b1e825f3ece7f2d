"""Where bytes come from: local files and mmaps (in ``formats/``), and S3-compatible object storage.

* :mod:`tokenmill.storage.s3`: ``s3://`` URLs and the one retrying boto3 client everything uses
  (stat, exists, ranged GET, download, upload, glob).
* :mod:`tokenmill.storage.object_storage`: ``ObjectStorageConfig`` (megatron-core's fields plus
  chunk-cache settings) and the local cache layout ``<cache>/<bucket>/<key>``.
* :mod:`tokenmill.storage.chunk_cache`: a bounded LRU of aligned chunks with prefetch.
* :mod:`tokenmill.storage.remote`: ``S3BinReader`` (an object through the chunk cache) and
  ``RemoteArray`` (a token array view of it).
* :mod:`tokenmill.storage.local_cache`: ``.idx`` files and sidecars downloaded once per node and
  object version, atomically, under a file lock.
* :mod:`tokenmill.storage.staging`: outputs written locally, then uploaded (data first).

Nothing here is imported by ``import tokenmill``; boto3 is imported on the first request.
"""
