"""The command group every verb registers on (``cli``), how a verb turns bad input, or a
worker that cannot start, into exit code 2 (``handles_bad_input``), how a long verb stops on
SIGTERM and SIGHUP as on Ctrl-C (``stop_signals_interrupt``), and the ``--device`` option every
verb that runs a kernel shares (``device_option``)."""
from __future__ import annotations

import contextlib
import functools
import signal
import sys

import click

from kfuzz.devices import DeviceError, resolve_device
from kfuzz.errors import KfuzzError, WorkerStartError
from kfuzz.target import prepare_triton


def handles_bad_input(fn):
    """Turn KfuzzError (bad input) and WorkerStartError (a worker this machine cannot start)
    into a clear message on stderr and exit code 2."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except (KfuzzError, WorkerStartError) as e:
            click.echo(f"kfuzz: error: {e}", err=True)
            sys.exit(2)
    return wrapper


@contextlib.contextmanager
def stop_signals_interrupt():
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as SIGINT does, inside the block: a verb
    stopped by its machine's end or a job scheduler still ends its processes and writes what it
    has."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    saved = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@click.group()
@click.version_option(package_name="kfuzz")
def cli():
    """kfuzz: find the inputs on which a kernel disagrees with its float64 oracle."""


def _device(ctx, param, value: str) -> str:
    try:
        device = resolve_device(value)
    except DeviceError as e:
        raise click.BadParameter(str(e), ctx, param) from None
    prepare_triton(device)      # before any target module is imported, in this process and its children
    return device


def device_option(fn):
    """``--device``, resolved on this machine before the verb runs (``kfuzz.devices``): auto
    (the default) is cuda where torch sees a GPU, else cpu; a device the machine lacks, or
    text that names no device, is bad usage (exit 2) before anything is read or saved.  On
    cpu, Triton kernels run under Triton's interpreter, also on a machine with a GPU."""
    return click.option("--device", default="auto", show_default=True, callback=_device,
                        help="auto (cuda where torch sees a GPU, else cpu), cpu, cuda or cuda:N.")(fn)
