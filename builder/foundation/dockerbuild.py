"""A build on the engine, through builder.foundation.dockerio's client: the log stream read line by line
into the step it is at, the intermediate images it made and the image ID it reports; a build that fails or
is interrupted is stopped, and every container and image it made removed.

Like the rest of the adapter, every expected failure is a one-line BuilderError; the SDK's own
exceptions come from dockerio, which alone imports ``docker``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from builder.errors import BuilderError
from builder.foundation.canon import file_lock
from builder.foundation.dockerio import DockerException, RequestException, _call, client

_SHORT_ID = re.compile(r"^ ---> ([0-9a-f]{12,64})\s*$")
_RUNNING_IN = re.compile(r"^ ---> Running in ([0-9a-f]{12,64})\s*$")


def build(
    context_dir: str | os.PathLike[str],
    *,
    dockerfile: str = "Dockerfile",
    buildargs: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    network: str = "none",
    platform: str | None = None,
    tag: str | None = None,
    nocache: bool = False,
    cleanup: bool = False,
    on_log: Callable[[str], None] | None = None,
) -> str:
    """Build ``context_dir`` with the classic builder and return the image ID (``sha256:...``).

    ``network="none"``: RUN steps see no network. Log lines go to ``on_log`` as they arrive.
    ``cleanup=True`` removes the intermediate images this build created (earlier stages), so the
    next build of the same recipe starts from nothing. A failing step raises BuilderError naming
    the step and the engine's message. A build that fails or is interrupted (KeyboardInterrupt, any
    exception) leaves nothing behind (no ``<none>`` image): see _abandon.
    """
    ctx = Path(context_dir)
    if not (ctx / dockerfile).is_file():
        raise BuilderError(f"{ctx / dockerfile}: no such Dockerfile")
    api = client().api
    step = ""
    image_id: str | None = None
    created: list[str] = []
    containers: list[str] = []
    stream: Any = None
    response: Any = None
    last_was_cache = False
    pending = ""
    quiet = False  # (set while an abandoned build's stream is read to its end: no more log lines)

    def emit(text: str) -> None:
        nonlocal step, last_was_cache, pending
        pending += text
        while "\n" in pending:
            line, pending = pending.split("\n", 1)
            line = line.rstrip("\r")
            if line.startswith("Step "):
                step = line
            running = _RUNNING_IN.match(line)
            if running:
                containers.append(running.group(1))
            elif line.strip() == "---> Using cache":
                last_was_cache = True
            else:
                m = _SHORT_ID.match(line)
                if m:
                    if not last_was_cache:
                        created.append(m.group(1))
                    last_was_cache = False
            if on_log is not None and not quiet:
                on_log(line)

    kwargs: dict[str, Any] = {
        "path": str(ctx),
        "dockerfile": dockerfile,
        "tag": tag,
        "buildargs": dict(buildargs or {}),
        "labels": dict(labels or {}),
        "network_mode": network,
        "nocache": nocache,
        "pull": False,
        "rm": True,
        "forcerm": True,
        "decode": True,
        "use_config_proxy": False,
    }
    if platform:
        kwargs["platform"] = platform

    def run() -> None:
        nonlocal image_id, stream, response
        stream = api.build(**kwargs)
        # (the SDK's generator holds the HTTP response, and never closes it itself)
        response = stream.gi_frame.f_locals.get("response") if getattr(stream, "gi_frame", None) else None
        for item in stream:
            if "stream" in item:
                emit(str(item["stream"]))
            elif "error" in item or "errorDetail" in item:
                emit("\n")
                detail = item.get("errorDetail") or {}
                message = " ".join(str(detail.get("message") or item.get("error") or "failed").split())
                where = f" at {step}" if step else ""
                raise BuilderError(f"docker build of {ctx}{where}: {message}")
            elif "aux" in item and isinstance(item["aux"], dict) and "ID" in item["aux"]:
                # Each stage reports its image; the last one is the result.
                image_id = str(item["aux"]["ID"])
        emit("\n")

    done = False
    try:
        _call(f"docker build of {ctx}", run)
        done = image_id is not None
    finally:
        if not done:  # failed or interrupted: stop the build, then remove what it made
            quiet = True
            _abandon(api, stream, response, emit, containers, created)
        elif cleanup:
            _remove_intermediates(created, keep=image_id)
    if image_id is None:
        raise BuilderError(f"docker build of {ctx}: the engine reported no image ID")
    return image_id


@contextlib.contextmanager
def turn(context_dir: str | os.PathLike[str], dockerfile: str = "Dockerfile") -> Iterator[None]:
    """Held around a build and its clean-up: builds on this machine that may share an intermediate image
    take turns; others run at once. Two builds share one where their recipes' first two instructions
    (the base, and the first step that makes an image) are alike. The engine's cache answers a step with
    the newest image made by it, so a build that removes what it made (a failed, interrupted or
    from-nothing build) would otherwise take an image from under a concurrent build that was answered
    with it ("No such image" at its next step), or leave the images that build put on it behind."""
    try:
        text = (Path(context_dir) / dockerfile).read_text(encoding="utf-8", errors="replace").replace("\\\n", " ")
    except OSError:
        text = ""  # (the build names the missing file; every such build takes the one turn)
    steps = [" ".join(ln.split()) for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    shared = hashlib.sha256("\n".join(steps[:2]).encode()).hexdigest()[:16]
    with file_lock(turn_dir() / f"{shared}.lock"):
        yield


#: the turns' locks: one folder for every builder on this machine, whatever its TMPDIR (a CI job, a test
#: or a user may set their own), as the engine they build on is the machine's; open to every user, as /tmp is
TURN_DIR = Path("/tmp/builder-image-build")


def turn_dir() -> Path:
    try:
        TURN_DIR.mkdir(mode=0o700)
    except FileExistsError:
        return TURN_DIR
    os.chmod(TURN_DIR, 0o1777)  # (mkdir's mode is cut by the umask)
    return TURN_DIR


#: seconds an abandoned build's stream is read for the IDs of what it made, at most
ABANDON_SECONDS = 60.0


def _abandon(api: Any, stream: Any, response: Any, emit: Callable[[str], None], containers: list[str],
             created: list[str]) -> None:
    """A build that failed or was interrupted: stop it and remove every container and image it made.
    The engine names each in the build's stream, and may still be committing a step when the
    interrupt comes (closing the stream at once would leave that step's image unnamed), so the
    stream is read to its end, removing each step's container as it starts (the step then fails and
    the build ends), at most ABANDON_SECONDS; then the images it made are removed, newest first."""

    def stop_containers() -> None:
        for cid in containers:
            with contextlib.suppress(DockerException, RequestException):
                api.remove_container(cid, force=True, v=True)

    def items() -> Iterator[dict[str, Any]]:
        if stream is not None and getattr(stream, "gi_frame", None) is not None:
            yield from stream  # (suspended between items: it goes on where the caller stopped)
        elif response is not None:
            # the interrupt came inside the SDK's generator, which is gone: read the rest raw
            # (the first, cut line does not parse and is passed over)
            buf = b""
            for chunk in api._stream_helper(response, decode=False):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for ln in lines:
                    with contextlib.suppress(ValueError):
                        item = json.loads(ln)
                        if isinstance(item, dict):
                            yield item

    deadline = time.monotonic() + ABANDON_SECONDS
    stop_containers()
    with contextlib.suppress(Exception):
        for item in items():
            seen = len(containers)
            if "stream" in item:
                emit(str(item["stream"]))
            if len(containers) > seen:
                stop_containers()
            if time.monotonic() > deadline:
                break
        emit("\n")
    for closing in (stream, response):
        with contextlib.suppress(Exception):
            if closing is not None:
                closing.close()
    stop_containers()
    _remove_intermediates(created, keep=None)


def _remove_intermediates(short_ids: Sequence[str], *, keep: str | None) -> None:
    """Remove intermediate images, newest first (removing a leaf also drops its untagged parents)."""
    api = client().api
    for sid in reversed(short_ids):
        if keep and keep.removeprefix("sha256:").startswith(sid):
            continue
        with contextlib.suppress(DockerException, RequestException):
            api.remove_image(sid, force=False, noprune=False)
