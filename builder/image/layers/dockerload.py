"""Normalising an image the engine built, and saving one deterministically: the steps that need docker."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from builder.errors import BuilderError
from builder.foundation.canon import run_folder
from builder.image.layers.read import normalize_image, read_image
from builder.image.layers.spooled import SpooledImage
from builder.image.layers.write import archive_chunks, write_archive

# builder.foundation.dockerio loads the Docker SDK as it is imported: it is imported inside the two functions that
# talk to the engine, so importing builder.image.layers (as `builder image --plan` does) stays cheap.


def normalize_and_load(
    ref: str,
    *,
    source_date_epoch: int,
    base_layers: int | Sequence[str] = 0,
    labels: Mapping[str, str] | None = None,
    repo_tags: Sequence[str] = (),
    workdir: str | os.PathLike[str] | None = None,
) -> SpooledImage:
    """Save ``ref`` from the engine, normalize it, load the result and check the engine's ID.

    Raises BuilderError if the engine reports a different image ID than the one computed.
    """
    from builder.foundation import dockerio

    with _workdir(workdir) as work:
        record = normalize_image(
            dockerio.save(ref),
            work,
            source_date_epoch=source_date_epoch,
            base_layers=base_layers,
            labels=labels,
        )
        loaded = dockerio.load(archive_chunks(record, repo_tags=repo_tags, mtime=source_date_epoch))
    if loaded != record.image_id:
        raise BuilderError(f"docker load of {ref}: engine reports {loaded}, computed {record.image_id}")
    return record


def save_archive(
    ref: str,
    dest: str | os.PathLike[str],
    *,
    repo_tags: Sequence[str] = (),
    mtime: int = 0,
    workdir: str | os.PathLike[str] | None = None,
) -> tuple[SpooledImage, str]:
    """A deterministic ``docker save``: (record, archive sha256 hex) for an image in the engine."""
    from builder.foundation import dockerio

    with _workdir(workdir) as work:
        record = read_image(dockerio.save(ref), work)
        digest = write_archive(record, dest, repo_tags=repo_tags, mtime=mtime)
    return record, digest


@contextlib.contextmanager
def _workdir(workdir: str | os.PathLike[str] | None) -> Iterator[Path]:
    if workdir is not None:
        yield Path(workdir)
        return
    with run_folder("builder-layers-") as tmp:
        yield tmp
