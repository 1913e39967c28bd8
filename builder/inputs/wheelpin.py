"""The pin of a wheel set: the Python distributions an image installs, named by a hash-pinned requirements file.

``[wheels.NAME] requirements = "images/vllm-cpu/requirements.lock"`` names a file in the project in pip's
hash-checking form: one ``name==version`` per distribution, each with its ``--hash=sha256:...``. The
file is the pin: builder.lock.wheelset locks each requirement to the one wheel file whose sha256 the
file lists (its filename, size and sha256 go into the lock), and an image that lists the set in
``wheels = [...]`` gets every one of those wheels, verified from the store, in its build context at
``wheels/`` (builder.image.wheels), for a ``pip install --no-index --require-hashes`` with the network off.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from pydantic import Field, field_validator

from builder.inputs.schema import Strict


class WheelSet(Strict):
    """A set of wheels named by a requirements file in the project (pip's ``--require-hashes`` form)."""

    requirements: str = Field(min_length=1, description="a file in the project, relative to pins.toml")
    note: str | None = None

    @field_validator("requirements")
    @classmethod
    def _inside(cls, v: str) -> str:
        p = PurePosixPath(v)
        if p.is_absolute() or ".." in p.parts or "\\" in v:
            raise ValueError("must be a path inside the project (relative, no '..')")
        return p.as_posix()
