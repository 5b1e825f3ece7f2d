"""``python -m tokenmill.megatron SCRIPT [ARGS...]``: run an unchanged Megatron script on tokenmill.

Calls :func:`tokenmill.megatron.patch_megatron`, then runs SCRIPT as ``__main__`` exactly as
``python SCRIPT ARGS...`` would (``sys.argv`` is ``[SCRIPT, *ARGS]`` and the script's directory
leads ``sys.path``). ``-m MODULE`` runs a module instead, as ``python -m MODULE ARGS...`` would.
It composes with torchrun::

    torchrun --nproc-per-node 8 --module tokenmill.megatron pretrain_gpt.py --data-path ...

(torchrun runs ``python -m tokenmill.megatron pretrain_gpt.py ...`` on every rank).
"""

from __future__ import annotations

import os
import runpy
import sys

from tokenmill.megatron import patch_megatron

_USAGE = (
    "usage: python -m tokenmill.megatron SCRIPT [ARGS...]\n"
    "       python -m tokenmill.megatron -m MODULE [ARGS...]\n"
    "Run a Megatron script (or module) with megatron.core.datasets served by tokenmill."
)


def main(argv: list[str] | None = None) -> int:
    """Patch, then run the script or module of `argv` (default: ``sys.argv[1:]``) as
    ``__main__``; returns the exit status for a bad command line (2), else 0 (the script's own
    ``sys.exit`` propagates)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    patch_megatron()
    if args[0] == "-m":
        if len(args) < 2:
            print(_USAGE, file=sys.stderr)
            return 2
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    script = args[0]
    if not os.path.exists(script):
        print(
            f"python -m tokenmill.megatron: cannot open {script!r}: no such file", file=sys.stderr
        )
        return 2
    sys.argv = args
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
