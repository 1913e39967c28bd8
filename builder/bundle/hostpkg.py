"""install.pyz: builder.onhost as one zipapp, the one form in which the host side reaches a host (in a
bundle, and kept by ship and deploy as ``<paths.bundles>/incoming/install-<sha256[:16]>.pyz``).

Deterministic, so that the same source gives the same bytes and a bundle made again is byte-identical:
the package's modules only (no ``__pycache__``), in sorted order, each stored (deflate's output
depends on the zlib build), dated 1980-01-01, mode 0644, behind a ``#!/usr/bin/env python3`` line.
Inside, the package is ``onhost/`` (its imports are relative) and ``__main__.py`` runs its ``cli``.

``python3 -m builder.bundle.hostpkg FILE`` writes it (the operator's trusted copy for the first
install of a sneakernet host).
"""

from __future__ import annotations

import functools
import hashlib
import io
import sys
import zipfile
from pathlib import Path

from builder import onhost
from builder.onhost.files import atomic_write

NAME = "install.pyz"
SHEBANG = b"#!/usr/bin/env python3\n"
#: the package's name inside the zipapp
PACKAGE = "onhost"
MAIN = b'"""python3 install.pyz COMMAND ...: builder\'s host side (builder.onhost)."""\n\nimport sys\n\n' \
       b"from onhost.cli import main\n\nsys.exit(main())\n"
#: the earliest time a zip entry can carry
EPOCH = (1980, 1, 1, 0, 0, 0)


def sources() -> list[tuple[str, bytes]]:
    """(name in the zipapp, bytes) of every module of builder.onhost, sorted by name."""
    pkg = Path(onhost.__file__).parent
    return sorted((f"{PACKAGE}/{p.name}", p.read_bytes()) for p in pkg.glob("*.py"))


@functools.cache
def zipapp() -> bytes:
    """The bytes of install.pyz (made once per process: its source does not change under it)."""
    buf = io.BytesIO()
    buf.write(SHEBANG)
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in [("__main__.py", MAIN), *sources()]:
            info = zipfile.ZipInfo(name, date_time=EPOCH)
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3  # unix, so that the mode below is read as one
            info.external_attr = (0o100644 & 0xFFFF) << 16
            z.writestr(info, data)
    return buf.getvalue()


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
