"""The one exception family builder raises for expected failures.

Every expected failure carries an exit code (see DESIGN.md):
0 done; 1 the work failed or drift was found; 2 usage or configuration error
(raised before anything was changed); 3 a host could not be reached; 130 Ctrl-C, 143 SIGTERM,
129 SIGHUP, each after the same cleanup (``Stopped``).
The CLI turns these into one line on stderr; nothing else is printed.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, as Ctrl-C raises KeyboardInterrupt: a subclass of
    it, so every cleanup that runs for Ctrl-C (``finally`` blocks, ``except KeyboardInterrupt``) runs for
    these as well. The CLI exits 128 + the signal's number: 143 for SIGTERM, 129 for SIGHUP."""

    def __init__(self, signum: int, name: str) -> None:
        super().__init__(name)
        self.exit_code = 128 + signum
        self.name = name


class BuilderError(Exception):
    """An expected failure: one line for the user and an exit code."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = " ".join(message.split()) if "\n" in message else message
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message


class ConfigError(BuilderError):
    """Bad input (a file, a key, a flag): exit 2, nothing was changed."""

    exit_code = EXIT_CONFIG


class ResolveError(BuilderError):
    """An input could not be resolved or did not match its pin: exit 1."""

    exit_code = EXIT_FAILED


class VerifyError(BuilderError):
    """Bytes did not match their recorded hash or signature: exit 1."""

    exit_code = EXIT_FAILED


class UnreachableError(BuilderError):
    """A host could not be reached: exit 3."""

    exit_code = EXIT_UNREACHABLE


def unnamed(name: str, message: str) -> str:
    """``message`` without the leading ``name: `` a host's errors begin with (``spark-1: stop: ...``),
    for a place that names the host already (a table's host column)."""
    return message[len(name) + 2:] if message.startswith(f"{name}: ") else message


def named(name: str, message: str, what: str = "") -> str:
    """``name: [what: ]message`` with the name once: a host's errors already begin with its name, and
    whoever reports them per host must not say it twice."""
    rest = unnamed(name, message)
    return f"{name}: {what}: {rest}" if what else f"{name}: {rest}"
