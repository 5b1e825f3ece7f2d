"""Exclusive ownership of an output prefix, and worker processes that die with their parent.

Two ``tokenize`` (or ``merge``) jobs writing the same ``--output`` used to interleave their parts
and exit 0 with a dataset made of both. A writer now takes the prefix first:

* ``<dir>/.<name>.tokenmill-owner`` (hidden, beside the outputs) is created with ``O_CREAT | O_EXCL`` (atomic on local
  filesystems and NFSv3+) and records ``{"pid", "host", "run_id", "started"}``;
* a second writer finds it and raises :class:`OutputBusyError`: "X is being written by another
  tokenmill (pid P, host H)";
* an owner file whose pid is dead *on this host* is stale (a killed run): it is taken over by
  renaming it away (only one taker can rename the inode it read) and creating a fresh one, so a
  killed run resumes without manual cleanup; an owner on another host is never guessed dead;
* the owner removes the file on exit (if it is still its own); a nested `own_output` of the
  same prefix in the owning process (tokenize, then its merge) is a no-op.

Workers (:func:`die_with_parent`): a worker process asks the kernel for SIGKILL when its parent
dies (``prctl(PR_SET_PDEATHSIG)`` through ctypes, Linux), and a daemon thread also watches the
parent pid once a second (any POSIX, and the case where the kernel's "parent" is a fork server
rather than the job), so no worker outlives a killed job.

Why not ``filelock`` or ``fcntl.flock``: a lock carries no identity to put in the error ("pid P,
host H"), and ``flock`` is not reliable on the network filesystems outputs often live on, while
``O_EXCL`` creation is; the takeover rule (dead pid on this host only) needs the record anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from tokenmill.common.owner import pid_alive, pid_namespace
from tokenmill.errors import TokenmillError

__all__ = ["OWNER_SUFFIX", "OutputBusyError", "die_with_parent", "own_output", "owner_path"]

OWNER_SUFFIX = ".tokenmill-owner"
_PR_SET_PDEATHSIG = 1
_MAX_OWNER_BYTES = 4096


class OutputBusyError(TokenmillError, RuntimeError):
    """Another live tokenmill process owns the output prefix."""


def owner_path(prefix: str) -> str:
    """The owner file of an output prefix: hidden, beside the outputs."""
    directory, name = os.path.split(os.fspath(prefix))
    return os.path.join(directory, f".{name}{OWNER_SUFFIX}")


def _read_owner(path: str) -> dict[str, Any] | None:
    """The owner record, or None when it is unreadable (being written, or garbage)."""
    try:
        with open(path, "rb") as stream:
            data = stream.read(_MAX_OWNER_BYTES)
        record = json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _is_stale(record: dict[str, Any] | None, path: str) -> bool:
    if record is None:
        # a writer between O_EXCL and its write, or garbage: stale only once clearly old
        try:
            return time.time() - os.path.getmtime(path) > 60
        except FileNotFoundError:
            return True
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    # containers sharing a host name but not a pid namespace cannot see each other's pids
    if record.get("pid_namespace", pid_namespace()) != pid_namespace():
        return False
    return not pid_alive(pid)


@contextlib.contextmanager
def own_output(prefix: str, run_id: str | None = None) -> Iterator[str]:
    """Own ``prefix`` for the duration of the block (see the module docstring).

    Args:
        prefix: the output prefix (its directory must exist or be creatable).
        run_id: recorded in the owner file; a random one by default.

    Yields:
        The run id.

    Raises:
        OutputBusyError: a live process (or one on another host) owns the prefix.
    """
    prefix = os.fspath(prefix)
    path = owner_path(prefix)
    run_id = run_id or uuid.uuid4().hex
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "pid_namespace": pid_namespace(),
        "run_id": run_id,
        "started": time.time(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for _ in range(10):
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                found = _read_owner(path)
            except FileNotFoundError:
                continue  # the owner just left: try again
            if found and found.get("pid") == os.getpid() and found.get("host") == record["host"]:
                # already ours (tokenize owns the prefix and then merges into it): nested use
                yield str(found.get("run_id"))
                return
            if not _is_stale(found, path):
                pid = found.get("pid", "?") if found else "?"
                host = found.get("host", "?") if found else "?"
                raise OutputBusyError(
                    f"{prefix} is being written by another tokenmill (pid {pid}, host {host}); "
                    f"wait for it, or remove {path} if that process is gone"
                ) from None
            # take the stale file over: only one taker can rename the file it inspected
            moved = f"{path}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(path, moved)
            except FileNotFoundError:
                continue
            taken = _read_owner(moved) if os.path.exists(moved) else None
            if taken != found:  # another process's fresh owner file: give it back
                with contextlib.suppress(OSError):
                    os.rename(moved, path)
                continue
            with contextlib.suppress(OSError):
                os.unlink(moved)
            continue
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            json.dump(record, stream)
        break
    else:
        raise OutputBusyError(f"{prefix}: could not take ownership of {path} after 10 attempts")
    try:
        yield run_id
    finally:
        with contextlib.suppress(FileNotFoundError, OSError, ValueError):
            current = _read_owner(path)
            if current is not None and current.get("run_id") == run_id:
                os.unlink(path)


def _watch_parent(parent: int, direct: bool) -> None:
    while True:
        time.sleep(1.0)
        if (direct and os.getppid() != parent) or not pid_alive(parent):
            os._exit(1)  # the job is gone: nobody will read this worker's results


def die_with_parent(parent: int | None = None) -> None:
    """Make this (worker) process exit when ``parent`` (default: the current parent) dies.

    Call it first in a worker's initializer. It also makes the worker ignore SIGINT: Ctrl-C goes
    to the whole process group, and the parent alone decides how the job ends.
    """
    parent = os.getppid() if parent is None else parent
    with contextlib.suppress(ValueError, OSError):  # not the main thread, or no signals
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    name = ctypes.util.find_library("c")
    if name and os.uname().sysname == "Linux":
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(name, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if not pid_alive(parent):  # died before prctl took effect
        os._exit(1)
    direct = parent == os.getppid()
    threading.Thread(
        target=_watch_parent, args=(parent, direct), daemon=True, name="parent-watch"
    ).start()
