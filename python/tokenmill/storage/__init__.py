"""Where bytes come from: local files and mmaps (object storage follows)."""
