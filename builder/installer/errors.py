"""The host side's one kind of expected failure, its exit codes, and its progress lines."""

# ruff: noqa: UP031
from __future__ import annotations

import sys

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


class InstallError(Exception):
    """An expected failure: one line and an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(" ".join(str(message).split()))
        self.code = code


def say(message: str) -> None:
    sys.stderr.write("install: %s\n" % message)
    sys.stderr.flush()
