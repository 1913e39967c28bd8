"""The image as a `docker load` archive inside a bundle: streamed, byte-identical for the same image."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from builder.errors import ConfigError, VerifyError
from builder.foundation.canon import ChunkReader
from builder.foundation.hashing import READ_SIZE
from builder.image import layers


@contextlib.contextmanager
def image_archive(
    image_id: str, work: Path, *, tag: str | None = None, mtime: int = 0, omit: frozenset[str] = frozenset()
) -> Iterator[IO[bytes]]:
    """A `docker load` archive of the image, streamed, byte-identical for the same image.

    builder.image.layers re-exports the saved image canonically (sorted entries, fixed mtime, the config and
    layers untouched, every DiffID checked; spooled through ``work``).
    """
    # Imported here for start-up time: builder.foundation.dockerio loads the Docker SDK, which only --with-image
    # needs; deploy, status, start and stop import this module without it.
    from builder.foundation import dockerio

    if not dockerio.image_exists(image_id):
        raise ConfigError(
            f"--with-image: image {image_id} is not in the local Docker Engine (run `builder image`)"
        )
    image = layers.read_image(dockerio.save(image_id), work)
    if image.image_id != image_id:
        raise VerifyError(f"--with-image: the engine saved {image.image_id} for {image_id}")
    chunks = layers.archive_chunks(image, repo_tags=[tag] if tag else [], mtime=mtime, omit=omit)
    yield io.BufferedReader(ChunkReader(iter(chunks)), buffer_size=READ_SIZE)  # type: ignore[arg-type]
