"""One store write as its own process, for the kill tests: `python -m tests.lib.storeput STORE MODE SRC
DIGEST` puts, under DIGEST, through builder.store.content as `builder` itself does, into the store at STORE:
the file SRC (MODE `file`), a copy of the folder SRC (MODE `tree`), or (MODE `stall`) a stream that
writes 64 KiB, then creates the file SRC (a marker: the write has begun) and stalls until killed."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from builder.store.content import Store


def _stalled(marker: Path) -> Iterator[bytes]:
    yield b"a" * 65536
    marker.write_text("writing")
    while True:
        time.sleep(0.05)
        yield b""


def main(argv: list[str]) -> None:
    store, mode, src, digest = Path(argv[0]), argv[1], Path(argv[2]), argv[3]
    s = Store(store)
    if mode == "file":
        s.put_file(src, digest, "blob")
    elif mode == "tree":
        s.put_tree(digest, lambda d: shutil.copytree(src, d, dirs_exist_ok=True), "tree")
    else:
        s.put_stream(_stalled(src), digest, "files.big")


if __name__ == "__main__":
    main(sys.argv[1:])
