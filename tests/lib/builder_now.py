"""`python -m tests.lib.builder_now ARGS`: the builder CLI with its progress shown at once (no delay
before a bar appears), so that a short job on a test's pty draws its bars."""

from __future__ import annotations

import functools
import sys

from builder import output


def main() -> None:
    output.progress = functools.partial(output.progress, delay=0)  # type: ignore[assignment]
    # the CLI after the change: a module that binds `progress` at import gets the changed one
    from builder.cli import main as cli

    sys.argv[0] = "builder"
    cli()


if __name__ == "__main__":
    main()
