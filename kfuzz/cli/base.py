"""The command group every verb registers on (``cli``), and how a verb turns bad input into
exit code 2 (``handles_bad_input``)."""
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
