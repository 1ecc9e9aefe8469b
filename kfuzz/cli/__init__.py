"""kfuzz's command line: one module per verb, each thin over the library.

Exit codes: 0 all as expected, 1 a failure found or a regression, 2 bad usage
or bad input (the message names the file and what is wrong).
"""
from __future__ import annotations

import functools
import sys

import click

from kfuzz.errors import KfuzzError


def handles_bad_input(fn):
    """Turn KfuzzError into a clear message on stderr and exit code 2."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except KfuzzError as e:
            click.echo(f"kfuzz: error: {e}", err=True)
            sys.exit(2)
    return wrapper


@click.group()
@click.version_option(package_name="kfuzz")
def cli():
    """kfuzz: find the inputs on which a kernel disagrees with its float64 oracle."""


def main():
    from kfuzz.cli import audit, import_, minimize, replay, run, show, targets, verify  # noqa: F401  (registers the verbs)
    cli(prog_name="kfuzz")
