"""install.pyz on the operator's side: the zipapp of builder.installer and the builder.core it imports
(builder.installer.pack makes it), the one form in which the host side reaches a host: in every bundle
as ``install.pyz``, and kept by ship and deploy on the host by its sha256
(builder.store.placement.kept_installer).

``python3 -m builder.bundle.hostpkg FILE`` writes it (the operator's trusted copy for the first
install of a sneakernet host); ``python3 -m builder.installer assemble`` prints the same bytes.
"""

from __future__ import annotations

import functools
import hashlib
import sys

from builder.foundation.canon import atomic_write
from builder.installer import pack

NAME = pack.NAME


@functools.cache
def zipapp() -> bytes:
    """The bytes of install.pyz (made once per process: its source does not change under it)."""
    return pack.zipapp()


def sha256() -> str:
    return hashlib.sha256(zipapp()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python3 -m builder.bundle.hostpkg FILE (writes install.pyz there)\n")
        return 2
    try:
        atomic_write(args[0], zipapp(), 0o755)
    except OSError as e:
        sys.stderr.write(f"error: {args[0]}: {e.strerror or e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
