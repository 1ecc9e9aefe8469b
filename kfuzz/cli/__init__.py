"""kfuzz's command line: one module per verb, each thin over the library, registered on the
group ``cli`` (``kfuzz.cli.base``) when imported; ``main`` imports them all.

Exit codes: 0 all as expected, 1 a failure found or a regression, 2 bad usage
or bad input (the message names the file and what is wrong).
"""
from __future__ import annotations

from kfuzz.cli.base import cli, handles_bad_input

__all__ = ["cli", "handles_bad_input", "main"]


def main():
    from kfuzz.cli import audit, import_, minimize, replay, run, show, targets, verify  # noqa: F401  (registers the verbs)
    cli(prog_name="kfuzz")
