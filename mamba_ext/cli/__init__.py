"""Command-line programs, one module per command (see mamba_ext/__main__.py)."""
