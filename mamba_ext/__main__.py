"""Command line: ``python -m mamba_ext COMMAND [options]`` (also installed as ``mamba-ext``).

Each command lives in ``mamba_ext/cli/<command>.py`` with a ``main(argv)``; this module
only dispatches. The commands call the library as a user's script does (no
:func:`mamba_ext.configure_threads`, no environment change), so every figure they print is
that of a plain library call. Any error ends the command
with one line on stderr and exit status 1 (``MAMBA_EXT_TRACEBACK=1`` shows the traceback).
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

COMMANDS = {
    "gradcheck": "float64 finite-difference check of every block gradient",
    "bench": "forward+backward timing and memory (CPU, or --device gpu)",
    "train": "train a small byte-level Mamba-1 language model",
    "sample": "generate text from a checkpoint",
}


def usage() -> str:
    lines = ["usage: python -m mamba_ext COMMAND [options]   (or: mamba-ext COMMAND [options])",
             "", "commands:"]
    lines += [f"  {name:10s} {what}" for name, what in COMMANDS.items()]
    lines += ["", "python -m mamba_ext COMMAND --help shows the options of a command and their defaults."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"mamba_ext {__version__}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            print(f"error: unknown command {argv[0]!r}", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    try:
        mod = importlib.import_module(f"mamba_ext.cli.{argv[0]}")
        return mod.main(argv[1:])
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:          # e.g. `mamba-ext sample ... | head`
        return 1
    except Exception as e:           # one clear line, never a traceback
        if os.environ.get("MAMBA_EXT_TRACEBACK"):
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message} ({type(e).__name__}; set MAMBA_EXT_TRACEBACK=1 for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
