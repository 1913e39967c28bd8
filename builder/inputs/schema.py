"""The shared pieces of every pydantic schema: the strict base model and the field types.

pins.toml, pins.lock, the host inventories and the image records all refuse unknown keys and are
read-only once loaded; their hashes and names have one spelling each, defined here.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# the name rule is the installer's, which checks every name of a manifest on the host
from builder.installer.manifest import NAME_RE

SHA256_RE = r"^[0-9a-f]{64}$"
DIGEST_RE = r"^sha256:[0-9a-f]{64}$"
HEX40_RE = r"^[0-9a-f]{40}$"
PLATFORM_RE = r"^linux/(amd64|arm64)(/v8)?$"

#: a lane, image, input, fleet or host name
Name = Annotated[str, Field(pattern=NAME_RE)]
#: a sha256 as 64 lowercase hex digits
Sha256 = Annotated[str, Field(pattern=SHA256_RE)]
#: an OCI digest, ``sha256:`` and 64 hex digits
Digest = Annotated[str, Field(pattern=DIGEST_RE)]
#: a full git commit id
Hex40 = Annotated[str, Field(pattern=HEX40_RE)]
#: an image platform builder builds for
Platform = Annotated[str, Field(pattern=PLATFORM_RE)]


class Strict(BaseModel):
    """Unknown keys are refused and a loaded value cannot change."""

    model_config = ConfigDict(extra="forbid", frozen=True)
