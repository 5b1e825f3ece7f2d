"""Moving bytes: S3-compatible object storage, local object caches and transfers (local files are
read by ``formats/``, which gives the bytes their meaning and sits above this layer).

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
* :mod:`tokenmill.storage.manifest`, :mod:`~tokenmill.storage.transfer`,
  :mod:`~tokenmill.storage.publish`, :mod:`~tokenmill.storage.download`: manifests, uploads
  with a manifest and verified, resumable downloads; :mod:`~tokenmill.storage.remote_cache`:
  index caches named by a manifest or an ``s3://`` prefix, fetched once per node.

Nothing here is imported by ``import tokenmill``; boto3 is imported on the first request.
"""
