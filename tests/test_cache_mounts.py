"""A cache directory shared by two hosts, each through its own mount whose kernel caches names
and attributes (FUSE, like NFS without close-to-open consistency): a host must take an entry the
other committed even while its kernel still holds what it saw of that entry's files before
(docs/cache-protocol.md, invariant 2).

The sequence of tests/test_two_hosts.py's "kill" and "resume" rounds, made deterministic: host
b's builder created an entry's arrays (or its data-fingerprint sidecar) under their final names
(in a batch, O_EXCL) and was killed before writing them; host a's builder, finding those names
taken, wrote its files beside them and renamed them over, and committed the entry; host b's next
build then looks at the entry through its own mount, whose kernel remembers each such file as
the empty one b created. Each host
is a bindfs (FUSE) mount of one directory, with name and attribute timeouts of a minute (a FUSE
filesystem's stat cache, such as gcsfuse's), so the stale view lasts for the whole test rather
than bindfs's default second.

Needs root, /dev/fuse and bindfs, as tests/test_two_hosts.py does: skipped with the reason, or
failed when TOKENMILL_REQUIRE_TWO_HOSTS=1 (.ci/run sets it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rank_jobs import build_datasets, committed_files, samples_digest, write_shards
from test_two_hosts import _mounted, fuse_unavailable

pytestmark = pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning")

# how long each mount's kernel keeps a name and its attributes without asking bindfs again
CACHE_SECONDS = 60


@contextlib.contextmanager
def _host_views(shared: Path, *views: Path) -> Iterator[None]:
    """Each of `views` a bindfs mount of `shared` with its own kernel name and attribute
    caches, unmounted at the end."""
    timeouts = f"attr_timeout={CACHE_SECONDS},entry_timeout={CACHE_SECONDS}"
    try:
        for view in views:
            view.mkdir()
            subprocess.run(
                ["bindfs", "-o", timeouts, str(shared), str(view)],
                check=True,
                capture_output=True,
                timeout=60,
            )
        yield
    finally:
        for view in views:
            for unmount in (["fusermount", "-u"], ["fusermount3", "-u"], ["umount", "-l"]):
                if not _mounted(view):
                    break
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run([*unmount, str(view)], capture_output=True, timeout=60)
    assert not [view for view in views if _mounted(view)], "a mount survived its unmount"


@pytest.mark.parametrize("created", [".npy", "-data.tokenmill.json"], ids=["arrays", "sidecars"])
def test_a_host_takes_an_entry_committed_over_the_empty_files_its_killed_builder_created(
    tmp_path: Path, created: str
) -> None:
    """`created`: which of its entries' files host b's killed builder had created under their
    final names (the arrays of the entries it handed to its writer; the data-fingerprint
    sidecar of an entry sealed SEAL_LAG entries later)."""
    missing = fuse_unavailable()
    if missing is not None:
        if os.environ.get("TOKENMILL_REQUIRE_TWO_HOSTS") == "1":
            pytest.fail(f"TOKENMILL_REQUIRE_TWO_HOSTS=1, but {missing}")
        pytest.skip(missing)
    shards = write_shards(tmp_path)
    # what a single process builds: the entries' names (the same through any path_to_cache)
    reference = tmp_path / "reference"
    expected = samples_digest(build_datasets(shards, str(reference), 1, "global"))
    taken = sorted(name for name in os.listdir(reference) if name.endswith(created))
    assert taken
    shared = tmp_path / "shared"
    (shared / "cache").mkdir(parents=True)
    view_a, view_b = tmp_path / "view-a", tmp_path / "view-b"
    with _host_views(shared, view_a, view_b):
        # host b's builder, killed after its writer created the files under their final names
        # (O_EXCL, as in a batch) and before it wrote a byte: b's kernel now holds them as
        # empty files
        for name in taken:
            os.close(os.open(view_b / "cache" / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        # host a builds and commits every entry: where its in-place creates find the names
        # taken, it writes beside them and renames its files over them
        assert samples_digest(build_datasets(shards, str(view_a / "cache"), 1, "global")) == (
            expected
        )
        committed = committed_files(shared / "cache")
        assert {name for name in committed if name.endswith(created)} == set(taken)
        assert all(record[2] > 0 for record in committed.values())
        # host b's next build: every entry is a hit through b's mount, nothing is rewritten
        digest = samples_digest(build_datasets(shards, str(view_b / "cache"), 1, "global"))
        assert digest == expected
        replaced = sorted(
            name
            for name, record in committed_files(shared / "cache").items()
            if committed.get(name) != record
        )
        assert not replaced, f"committed files removed or replaced: {replaced}"
