"""Command line: ``python -m mamba_ext COMMAND [options]``.

Each command lives in ``mamba_ext/cli/<command>.py`` with a ``main(argv)``.
"""
import importlib
import sys

COMMANDS = {
    "gradcheck": "float64 finite-difference check of every block gradient",
    "bench": "forward+backward timing and memory (CPU, or --device gpu)",
    "train": "train a small byte-level Mamba-1 language model",
    "sample": "generate text from a checkpoint",
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m mamba_ext COMMAND [options]\n\ncommands:")
        for name, what in COMMANDS.items():
            print(f"  {name:10s} {what}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    mod = importlib.import_module(f"mamba_ext.cli.{argv[0]}")
    return mod.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
