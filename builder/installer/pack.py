"""install.pyz: the installer and the core it imports as one zipapp, the form in which the host side
reaches a host.

Deterministic, so that the same source gives the same bytes and a bundle made again is
byte-identical: the modules of ``builder/core/`` and ``builder/installer/`` only (no ``__pycache__``),
in sorted order, each stored (deflate's output depends on the zlib build), dated 1980-01-01 (the
earliest a zip entry can carry), mode 0644, behind a ``#!/usr/bin/env python3`` line. Inside, the
packages keep their names, under a ``builder/__init__.py`` of the zipapp's own (a docstring: nothing
else of builder travels), so that the installer's imports of ``builder.core`` read the same on a host
as in a checkout; ``__main__.py`` runs the installer's ``main``.
"""

from __future__ import annotations

import io
import os
import zipfile

NAME = "install.pyz"
SHEBANG = b"#!/usr/bin/env python3\n"
#: the packages inside the zipapp, as they are named in builder
PACKAGES = ("core", "installer")
MAIN = (
    b'"""python3 install.pyz COMMAND ...: builder\'s host side (builder.installer)."""\n\nimport sys\n\n'
    b"from builder.installer.commands import main\n\nsys.exit(main())\n"
)
#: the zipapp's ``builder/__init__.py``: the parent of its two packages, and nothing else of builder
TOP = b'"""builder\'s host side in install.pyz: builder.installer and the builder.core it imports."""\n'
EPOCH = (1980, 1, 1, 0, 0, 0)
#: regular file, rw-r--r--, in the high half of external_attr (where unix zip tools keep st_mode)
ENTRY_MODE = 0o100644


def sources() -> list[tuple[str, bytes]]:
    """(name in the zipapp, bytes) of ``builder/__init__.py`` and every module of the packages,
    sorted by name."""
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = [("builder/__init__.py", TOP)]
    for pkg in PACKAGES:
        for name in sorted(os.listdir(os.path.join(top, pkg))):
            if name.endswith(".py"):
                with open(os.path.join(top, pkg, name), "rb") as f:
                    out.append((f"builder/{pkg}/{name}", f.read()))
    return sorted(out)


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
    """The bytes of install.pyz: made from these packages' files, or, when this runs from inside an
    install.pyz, that archive's own bytes (the same, since it was made this way)."""
    archive = getattr(getattr(__spec__, "loader", None), "archive", None)  # a zipimporter has one
    if archive:
        with open(archive, "rb") as f:
            return f.read()
    return build(sources())
