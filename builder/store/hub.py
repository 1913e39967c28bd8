"""A model file through huggingface_hub: ``hf_hub_download`` at the locked commit into the HF cache
the library computes, hashed behind the writer while it arrives, then checked and hard-linked into the
model store (builder.store.modelfetch decides which files come this way)."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Protocol

from builder.errors import BuilderError, ResolveError, VerifyError
from builder.foundation.hashing import READ_SIZE
from builder.lock import hf
from builder.store.modelstore import ModelStore, Wanted


class Progress(Protocol):
    """What a fetch tells its progress display (from its worker threads): each file's work as it starts
    (``verb``: ``get`` a download, ``hash`` a local copy or a download's bytes, ``verify`` a store
    object hashed again), the bytes as they are received or hashed, and each file's end."""

    def start(self, w: Wanted, verb: str) -> None: ...

    def advance(self, n: int) -> None: ...

    def finish(self, w: Wanted) -> None: ...


class NoProgress:
    def start(self, w: Wanted, verb: str) -> None:
        return None

    def advance(self, n: int) -> None:
        return None

    def finish(self, w: Wanted) -> None:
        return None


def _hub_reason(e: BaseException, token: str | None) -> str:
    """One line for why huggingface_hub could not download a file: the Hub's HTTP status (and its
    X-Error-Message), else the network error underneath, else the library's first line; scrubbed."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(e, HfHubHTTPError) and e.response is not None:
        why = e.response.headers.get("X-Error-Message") or ""
        line = f"HTTP {e.response.status_code} from the Hub" + (f" ({why})" if why else "")
        return hf.scrub(line, token)
    root: BaseException = e
    seen = 0
    while (root.__cause__ or root.__context__) is not None and seen < 8:
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
        seen += 1
    first = (str(root).strip().splitlines() or [type(root).__name__])[0]
    if root is not e:
        first = f"{type(root).__name__}: {first}"
    return hf.scrub(first, token)[:300]


class _Follower:
    """Hashes a download while huggingface_hub writes it, so that the check against the lock needs no
    second read of the whole file once it has arrived.

    huggingface_hub (2.x) writes an HTTP download into an incomplete file in the repo's ``blobs/``, named
    by its etag, beside the blob it becomes, front to back, and renames it into place. Its public cache
    API lists those files (``scan_cache_dir(...).incomplete_files``, each its path and size): the one in
    this repo's folder named by the file's etag, which for an LFS file is its sha256 (the one the lock
    names), is the download. (No public call gives the bytes of a download in flight, or the file a
    given ``hf_hub_download`` writes: the etag in its name is the one fact taken from the naming.) This
    reads it behind the writer (a reader never sees
    past the bytes already written: the size of a growing file counts only copied bytes), hashes each
    byte once, and once the download is done reads the rest through the same descriptor. Its answer
    is used only when it holds for the file huggingface_hub kept (the same inode, the locked size) and
    names the locked sha256; anything else (no such file, two of them, a restart from zero, a Xet
    download, whose chunks are written out of order) sends the file to the full read instead."""

    def __init__(self, cache: Path, repo: str, w: Wanted) -> None:
        self.cache, self.blobs, self.w = cache, cache / hf.repo_folder_name(repo) / "blobs", w
        self.h = hashlib.sha256()
        self.pos = 0
        self.fd: int | None = None
        self.ok = True
        self.closing = False
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.buf = bytearray(READ_SIZE)

    def begin(self) -> None:
        """huggingface_hub has opened its temporary file (its bar is being made): follow it, from a thread
        of its own, so that the download does not wait for the cache scan that finds the file."""
        if self.thread is not None or not self.ok:
            return
        self.thread = threading.Thread(target=self._run, name=f"hash {self.w.path}", daemon=True)
        self.thread.start()

    def _open(self) -> bool:
        """Open the download in flight; False (and the file read in full later) when it is not found as
        exactly one file, or is gone already (renamed into place before the scan ended)."""
        found = self._in_flight()
        if len(found) != 1:
            self.ok = False
            return False
        try:
            self.fd = os.open(found[0], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self.ok = False
            return False
        return True

    def _in_flight(self) -> list[Path]:
        """The incomplete downloads huggingface_hub's cache scan lists for this file (by its etag). The
        scan walks the whole cache (about 0.3 s for 5,000 cached files on 2 busy cores), beside the
        download, once per file."""
        from huggingface_hub import scan_cache_dir

        try:
            incomplete = getattr(scan_cache_dir(self.cache), "incomplete_files", None) or ()
            blobs = self.blobs.resolve()
            return [Path(f.file_path) for f in incomplete
                    if Path(f.file_path).parent.resolve() == blobs
                    and Path(f.file_path).name.startswith(f"{self.w.sha256}.")]
        except Exception:  # (the scan's errors: the file is then read in full once it has arrived)
            return []

    def poke(self) -> None:
        with self.cond:
            self.cond.notify()

    def spoil(self) -> None:
        """What was read may not be what the file holds (huggingface_hub started it again)."""
        self.ok = False
        self.poke()

    def _read_available(self) -> None:
        assert self.fd is not None
        view = memoryview(self.buf)
        while self.ok:
            n = os.preadv(self.fd, [self.buf], self.pos)
            if not n:
                return
            self.h.update(view[:n])
            self.pos += n
            if self.pos > self.w.size:
                self.ok = False

    def _run(self) -> None:
        try:
            if not self._open():
                return
            while True:
                self._read_available()
                with self.cond:
                    if self.closing or not self.ok:
                        return
                    self.cond.wait(timeout=0.05)
        except OSError:
            self.ok = False

    def finish(self, final: Path | None) -> tuple[str, int] | None:
        """(sha256, size) of the file huggingface_hub kept at ``final``, or None (then read it in full)."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join()
        if self.fd is None:
            return None
        try:
            if not self.ok or final is None:
                return None
            self._read_available()  # the rest: the file is whole now, under its final name
            mine, theirs = os.fstat(self.fd), os.stat(os.path.realpath(final))
            if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino) or mine.st_size != self.pos:
                return None
            return (self.h.hexdigest(), self.pos) if self.ok else None
        except OSError:
            return None
        finally:
            os.close(self.fd)
            self.fd = None


def _bar_class(progress: Progress, follower: _Follower | None = None) -> type:
    """The ``tqdm_class`` huggingface_hub is given: it reports the bytes of a download to ``progress``
    (huggingface_hub draws nothing of its own) and wakes the follower that hashes them. Its calls: a
    download's bar is made with ``total`` and ``initial`` (a Xet download's also with ``bar_format``);
    ``update(n)`` per chunk (negative when a server ignored a resume's Range and the file starts
    again); Xet downloads also call ``update_transfer`` (network bytes: not counted, the file's are)
    and ``set_postfix_str``."""

    class _Bytes:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = int(kwargs.get("initial") or 0)
            self.total = kwargs.get("total")
            self.desc = kwargs.get("desc", "")
            self.disable = False
            self.format_dict: dict[str, Any] = {}
            if follower is not None:
                if "bar_format" in kwargs:  # Xet: written in chunks out of order
                    follower.spoil()
                else:
                    follower.begin()

        def __enter__(self) -> _Bytes:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            k = int(n or 0)
            self.n += k
            progress.advance(k)
            if follower is not None:
                follower.spoil() if k < 0 else follower.poke()

        def update_transfer(self, n: float | None = 1) -> None:
            return None

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            return None

        def set_transfer_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            return None

        def close(self) -> None:
            return None

    return _Bytes


def download(store: ModelStore, repo: str, w: Wanted, progress: Progress | None = None) -> Path:
    """The file at the locked commit through huggingface_hub (``hf_hub_download``) into the HF cache,
    then hashed and hard-linked into the store. Returns the HF cache's path. ResolveError naming the
    file when huggingface_hub cannot download it; VerifyError (the HF cache's copy removed) when its
    bytes are not the locked ones."""
    # the library's download code is imported here, where a file is downloaded: about 0.4 s that a
    # fetch with every file already in the store does not pay
    from huggingface_hub import get_token, hf_hub_download

    progress = progress or NoProgress()
    _quiet_library()
    token = get_token()  # HF_TOKEN, else the token `hf auth login` stored: huggingface_hub's own rule
    cache = hf.hub_cache()
    follower = _Follower(cache, repo, w)
    progress.start(w, "get")
    got: Any = None
    try:
        got = hf_hub_download(repo, w.path, revision=w.commit, cache_dir=cache, token=token,
                              endpoint=os.environ.get("HF_ENDPOINT") or None,
                              tqdm_class=_bar_class(progress, follower))
    except OSError as e:
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        if e.errno is not None and e.strerror and not isinstance(e, (HfHubHTTPError, LocalEntryNotFoundError)):
            # a local write (a full disk): huggingface_hub removed its partial file
            raise BuilderError(f"{w.where}: cannot write into the HF cache {cache}: {e.strerror}") from None
        raise ResolveError(f"{w.where}: {repo}@{w.commit[:12]}: {_hub_reason(e, token)}") from None
    except Exception as e:  # the library's and its HTTP client's errors: one scrubbed line
        raise ResolveError(f"{w.where}: {repo}@{w.commit[:12]}: {_hub_reason(e, token)}") from None
    finally:
        hashed = follower.finish(Path(str(got)) if got is not None else None)
        progress.finish(w)
    path = Path(str(got))
    progress.start(w, "hash" if hashed is None else "check")
    try:
        store.import_file(path, w, hashed=hashed)
    except VerifyError as e:
        hf.forget_cached(repo, w.commit, w.path, cache)
        raise VerifyError(f"{e}; removed (from the HF cache too)") from None
    finally:
        progress.finish(w)
    return path


def _quiet_library() -> None:
    """huggingface_hub speaks only through builder: its log lines (a resumed download's URL) and its
    warnings (little free disk space, before the write that fails) stay off stderr; what fails is
    named by builder, one line a file."""
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"huggingface_hub(\..*)?")


def offline_mode() -> bool:
    """Whether huggingface_hub is told to stay offline (HF_HUB_OFFLINE): it would download nothing."""
    from huggingface_hub import constants  # at first use: the library reads HF_HUB_OFFLINE at this import

    return bool(constants.is_offline_mode())
