"""install.pyz: this package as one zipapp, the form in which the host side reaches a host.

Deterministic, so that the same source gives the same bytes and a bundle made again is
byte-identical: the package's modules only (no ``__pycache__``), in sorted order, each stored
(deflate's output depends on the zlib build), dated 1980-01-01 (the earliest a zip entry can carry),
mode 0644, behind a ``#!/usr/bin/env python3`` line. Inside, the package is ``installer/`` (its imports
are relative) and ``__main__.py`` runs its ``cli``.
"""

from __future__ import annotations

import io
import os
import zipfile

NAME = "install.pyz"
SHEBANG = b"#!/usr/bin/env python3\n"
#: the package's name inside the zipapp
PACKAGE = "installer"
MAIN = (
    b'"""python3 install.pyz COMMAND ...: builder\'s host side (builder.installer)."""\n\nimport sys\n\n'
    b"from installer.commands import main\n\nsys.exit(main())\n"
)
EPOCH = (1980, 1, 1, 0, 0, 0)
#: regular file, rw-r--r--, in the high half of external_attr (where unix zip tools keep st_mode)
ENTRY_MODE = 0o100644


def sources() -> list[tuple[str, bytes]]:
    """(name in the zipapp, bytes) of every module of this package, sorted by name."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                out.append((f"{PACKAGE}/{name}", f.read()))
    return out


def build(entries: list[tuple[str, bytes]]) -> bytes:
    """The zipapp of ``__main__.py`` and ``entries``, in that order, with fixed times and modes."""
    buf = io.BytesIO()
    buf.write(SHEBANG)
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in [("__main__.py", MAIN), *entries]:
            info = zipfile.ZipInfo(name, date_time=EPOCH)
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3  # unix, so that the mode below is read as one
            info.external_attr = ENTRY_MODE << 16
            z.writestr(info, data)
    return buf.getvalue()


def zipapp() -> bytes:
    """The bytes of install.pyz: made from this package's files, or, when this runs from inside an
    install.pyz, that archive's own bytes (the same, since it was made this way)."""
    archive = getattr(getattr(__spec__, "loader", None), "archive", None)  # a zipimporter has one
    if archive:
        with open(archive, "rb") as f:
            return f.read()
    return build(sources())
