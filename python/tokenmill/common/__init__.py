"""What every layer shares, below all of them: atomic file writes (`atomic`), the JSON sidecar
header (`sidecar`), rank/world coordination (`distributed`, `world`), thread-count defaults
(`threads`) and progress display (`progress`).

Nothing here imports another tokenmill package (only `tokenmill.errors`), torch or tqdm at import
time; see docs/architecture.md for the layers above.
"""
