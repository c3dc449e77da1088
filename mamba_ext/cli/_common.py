"""What every command shares: the argument parser's look and the thread settings."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and shows every option's default."""


def parser(command: str, doc: str | None, first_paragraph: bool = False) -> argparse.ArgumentParser:
    """The parser of ``python -m mamba_ext <command>``: its description is the command
    module's docstring (only its first paragraph with ``first_paragraph``)."""
    text = (doc or "").strip()
    if first_paragraph:
        text = text.split("\n\n")[0]
    return argparse.ArgumentParser(prog=f"python -m mamba_ext {command}", description=text,
                                   formatter_class=HelpFormatter)
