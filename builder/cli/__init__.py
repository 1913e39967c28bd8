"""The `builder` command: a click group that imports a subcommand's module when it runs.

Each subcommand lives in its own module under builder/cli/, parses its flags, calls one
core function and prints through builder.output. The group names each command and its one-line
help in ``COMMANDS``, so `builder --help` lists them without importing their stages.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from builder import __version__, output
from builder.cli.options import file_option, folder_option
from builder.errors import EXIT_INTERRUPTED, BuilderError, Stopped

# name -> (module, attribute, one-line help). The help is here so --help needs no import.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "lock": ("builder.cli.lock", "lock", "Resolve every input of pins.toml to an immutable id in the lock."),
    "diff": ("builder.cli.diff", "diff", "Show what moved between two locks."),
    "fetch": ("builder.cli.fetch", "fetch", "Put the locked model, kit and runtime files into the store, verified."),
    "image": ("builder.cli.image", "image", "Build (or plan) a content-addressed, reproducible image."),
    "why": ("builder.cli.image", "why", "Print an image's closure and input address."),
    "gc": ("builder.cli.image", "gc", "Remove store entries no lock refers to."),
    "keygen": ("builder.cli.bundle", "keygen", "Make an Ed25519 (minisign-compatible) signing key pair."),
    "push": ("builder.cli.push", "push", "Push a built image to a registry by digest (only the blobs it lacks)."),
    "launch": ("builder.cli.launch", "launch", "Show what each rank will run: its docker run, env and start order."),
    "bundle": ("builder.cli.bundle", "bundle", "Render a signed per-host launch bundle."),
    "verify": ("builder.cli.bundle", "verify", "Verify a bundle folder against its signature and hashes."),
    "ship": ("builder.cli.ship", "ship", "Copy a bundle to a host (or a folder) and install it."),
    "hosts": ("builder.cli.hosts", "hosts", "List fleets and hosts; write an Ansible inventory."),
    "audit": ("builder.cli.audit", "audit", "Check that hosts match the pins (testinfra)."),
    "deploy": ("builder.cli.deploy", "deploy", "Move a fleet to the lock, gated by the audit; roll back on failure."),
    "status": ("builder.cli.deploy", "status", "Which bundle, lock and image each host runs; which ranks are up."),
    "start": ("builder.cli.deploy", "start", "Start a fleet's installed release in the lane's start order."),
    "stop": ("builder.cli.deploy", "stop", "Stop a fleet's lane: the head, then the workers."),
}


@dataclass
class Ctx:
    pins: Path
    lock: Path
    store: Path
    root: Path


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        spec = COMMANDS.get(name)
        if spec is None:
            return None
        mod = importlib.import_module(spec[0])
        cmd = getattr(mod, spec[1])
        assert isinstance(cmd, click.Command)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in sorted(COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="builder")
@file_option("--pins", "pins", envvar="BUILDER_PINS",
             help="The pins file (its folder is the project root) [default: pins.toml here, else in the "
             "nearest folder above]. Env: BUILDER_PINS.")
@file_option("--lock", "lock", envvar="BUILDER_LOCK", help="The lock file [default: pins.lock beside the pins].")
@folder_option("--store", "store", envvar="BUILDER_STORE",
               help="The content-addressed store and caches [default: .cache/builder under the project root].")
@click.pass_context
def cli(ctx: click.Context, pins: Path | None, lock: Path | None, store: Path | None) -> None:
    """builder: make a DGX Spark lane reproducible and checkable.

    pins.toml -> lock -> image -> bundle -> install -> audit.
    """
    # (imported here: a command's --help does not load the schema)
    from builder.inputs.pins import default_lock, default_pins, default_store

    if pins is None:
        pins = default_pins()
    ctx.obj = Ctx(
        pins=pins,
        lock=lock if lock is not None else default_lock(pins),
        store=store if store is not None else default_store(pins),
        root=pins.resolve().parent,
    )


def get_ctx() -> Ctx:
    obj = click.get_current_context().find_object(Ctx)
    assert obj is not None
    return obj


#: the signals that end a command as Ctrl-C does, with their exit line
STOP_SIGNALS = {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}


def _stop(signum: int, _frame: object) -> None:
    # a second one while the first one's cleanup runs is ignored, so that cleanup finishes (Ctrl-C still
    # stops it, as a second Ctrl-C does)
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum, STOP_SIGNALS[signal.Signals(signum)])


def _stopped(e: BaseException) -> int:
    """One line for an interrupted command and its exit code: 130 for Ctrl-C, 128 + N for signal N."""
    cause = e if isinstance(e, Stopped) else e.__cause__ or e.__context__  # (click wraps it in Abort)
    if isinstance(cause, Stopped):
        sys.stderr.write(f"{cause.name}\n")
        return cause.exit_code
    sys.stderr.write("interrupted\n")
    return EXIT_INTERRUPTED


#: errors that come from the machine (a full disk, a read-only mount, a failing device), wherever met
_MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def main(argv: list[str] | None = None) -> Any:
    """Entry point: expected failures become one line on stderr and an exit code. SIGTERM and SIGHUP
    end a command as Ctrl-C does (the same cleanup), with their own exit code."""
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, _stop)
    try:
        rv = cli.main(args=argv, prog_name="builder", standalone_mode=False)
    except BuilderError as e:
        output.error(str(e))
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt) as e:
        sys.exit(_stopped(e))
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except BrokenPipeError:
        os._exit(1)
    except OSError as e:
        if e.errno not in _MACHINE_ERRNOS:
            raise  # a bug, with its traceback
        # the machine's state, not builder's: a full disk anywhere is one line, not a traceback
        output.error(f"{e.filename}: {e.strerror}" if e.filename else str(e.strerror or e))
        sys.exit(1)
    if isinstance(rv, int):
        sys.exit(rv)
    sys.exit(0)
