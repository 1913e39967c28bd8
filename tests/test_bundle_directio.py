"""builder.bundle.directio: part files written with O_DIRECT where the file system takes it, buffered
otherwise, the same bytes either way; and write_stream's output does not depend on which it got."""

from __future__ import annotations

import fcntl
import hashlib
import io
import mmap
import os
from pathlib import Path

import pytest

from builder.bundle import directio, parts
from builder.bundle.parts import write_stream

needs_o_direct = pytest.mark.skipif(not directio.O_DIRECT, reason="no O_DIRECT on this platform")


def _aligned(data: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, len(data))  # page-aligned, as O_DIRECT needs
    buf[:] = data
    return buf


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & directio.O_DIRECT)


@needs_o_direct
def test_aligned_writes_stay_direct(tmp_path: Path) -> None:
    fd, direct = directio.open_part(tmp_path / "p")
    if not direct:
        os.close(fd)
        pytest.skip("this file system refuses O_DIRECT")
    data = os.urandom(2 * directio.ALIGN)
    try:
        assert directio.write_all(fd, memoryview(_aligned(data)), 0, True) is True
        assert _is_direct(fd)
    finally:
        directio.sync_close(fd)
    assert (tmp_path / "p").read_bytes() == data


@needs_o_direct
def test_an_unaligned_tail_switches_the_file_to_buffered(tmp_path: Path) -> None:
    fd, direct = directio.open_part(tmp_path / "p")
    head, tail = os.urandom(directio.ALIGN), os.urandom(123)
    try:
        direct = directio.write_all(fd, memoryview(_aligned(head)), 0, direct)
        assert directio.write_all(fd, memoryview(tail), len(head), direct) is False
        assert not _is_direct(fd)
    finally:
        directio.sync_close(fd)
    assert (tmp_path / "p").read_bytes() == head + tail


@needs_o_direct
def test_an_unaligned_offset_switches_before_writing(tmp_path: Path) -> None:
    fd, direct = directio.open_part(tmp_path / "p")
    if not direct:
        os.close(fd)
        pytest.skip("this file system refuses O_DIRECT")
    try:
        directio.to_buffered(fd)
        os.write(fd, b"x")  # the file offset is now 1
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | directio.O_DIRECT)
        # an aligned buffer and length at an unaligned offset: a direct write would fail (EINVAL)
        assert directio.write_all(fd, memoryview(_aligned(b"y" * directio.ALIGN)), 1, True) is False
        assert not _is_direct(fd)
    finally:
        directio.sync_close(fd)
    assert (tmp_path / "p").read_bytes() == b"x" + b"y" * directio.ALIGN


def test_a_refused_direct_write_is_retried_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd, _ = directio.open_part(tmp_path / "p")
    real_write = os.write
    refused: list[int] = []

    def write(f: int, b: memoryview) -> int:
        if not refused:
            refused.append(len(b))
            raise OSError(22, "Invalid argument")  # what a file system that refuses O_DIRECT says
        return real_write(f, b)

    monkeypatch.setattr(os, "write", write)
    data = os.urandom(directio.ALIGN)
    try:
        assert directio.write_all(fd, memoryview(_aligned(data)), 0, True) is False
    finally:
        directio.sync_close(fd)
    assert refused and (tmp_path / "p").read_bytes() == data


def test_a_failed_buffered_write_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = os.open(tmp_path / "p", os.O_WRONLY | os.O_CREAT, 0o644)

    def write(f: int, b: memoryview) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", write)
    try:
        with pytest.raises(OSError, match="No space"):
            directio.write_all(fd, memoryview(b"abc"), 0, False)
    finally:
        os.close(fd)


def test_without_o_direct_parts_open_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directio, "O_DIRECT", 0)
    fd, direct = directio.open_part(tmp_path / "p")
    os.close(fd)
    assert direct is False


@pytest.mark.parametrize("o_direct", [True, False])
def test_write_stream_bytes_do_not_depend_on_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, o_direct: bool
) -> None:
    if not o_direct:
        monkeypatch.setattr(directio, "O_DIRECT", 0)
    elif not directio.O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    # two whole reads, a short read from the "pipe", a part boundary inside a read, and a short tail
    data = os.urandom(parts.READ_SIZE * 2 + 5000)
    part_size = parts.READ_SIZE + 4096
    dest = tmp_path / "b"
    w = write_stream(io.BufferedReader(io.BytesIO(data), buffer_size=1000), "big.bin", dest, part_size, "0644")
    assert (w.size, w.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    got = b"".join((dest / p["path"]).read_bytes() for p in w.parts)
    assert got == data
    for p in w.parts:
        assert hashlib.sha256((dest / p["path"]).read_bytes()).hexdigest() == p["sha256"]
    assert [p["size"] for p in w.parts] == [part_size, len(data) - part_size]
