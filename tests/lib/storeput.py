"""One store write as its own process, for the kill tests: `python -m tests.lib.storeput STORE MODE SRC
DIGEST` puts the file SRC (MODE `file`) or a copy of the folder SRC (MODE `tree`) into the store at STORE
under DIGEST, through builder.store as `builder` itself does."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from builder.store import Store


def main(argv: list[str]) -> None:
    store, mode, src, digest = Path(argv[0]), argv[1], Path(argv[2]), argv[3]
    s = Store(store)
    if mode == "file":
        s.put_file(src, digest, "blob")
    else:
        s.put_tree(digest, lambda d: shutil.copytree(src, d, dirs_exist_ok=True), "tree")


if __name__ == "__main__":
    main(sys.argv[1:])
