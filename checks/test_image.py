"""Image: present by ImageID, its tag points at it, labels and DiffIDs match the build record.

The expected image is the one `builder image` recorded for the lock's input address (ImageID =
sha256 of the config, DiffIDs = the uncompressed layers); every host is compared with that one
record, so "the same layers on every host" holds exactly when every host passes. With a lock
but no such record in the operator's store the checks fail (nothing else compares the host's
image with the lock); only without a lock do they skip.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from checklib import (
    Cmd,
    Concern,
    docker_objects,
    docker_objects_command,
    exists,
    expected_image,
    image_refs,
    inspect_images,
    or_skip,
    run,
)

_CACHE: dict[str, Any] = {}


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """The image's `docker inspect` (this rank's containers in the same call when a concern that
    declares containers runs too)."""
    return [docker_objects_command(expect)] if image_refs(expect) else []


CONCERN = Concern(name="image", order=10, phase="preflight", containers=False, prefetch=planned)


def _inspect(host: Any, ref: str, expect: dict[str, Any]) -> dict[str, Any] | None:
    """`docker image inspect` of the image's ID or tag (None: absent, or no engine answer).

    Both references are inspected by one answer (checklib.docker_objects, with this rank's
    containers when those checks run too). If its output cannot be matched up with them, each
    reference is inspected on its own.
    """
    if ref not in _CACHE:
        images = docker_objects(host, expect).images
        if images is not None:
            _CACHE.update(images)
        else:
            for x in image_refs(expect):
                one = run(host, *inspect_images([x]))
                data = json.loads(one.stdout or "[]") if one.rc == 0 else []
                _CACHE[x] = data[0] if data else None
    return _CACHE.get(ref)


@pytest.fixture(scope="module")
def image(host: Any, expect: dict[str, Any]) -> dict[str, Any]:
    img = expected_image(expect)  # (no build record for the lock's input address: fail)
    if not exists(host, "docker"):
        pytest.fail(f"docker CLI: expected on PATH to inspect image {img['image_id'][:19]}, found none")
    return img


def test_present_by_id(host: Any, image: dict[str, Any], expect: dict[str, Any]) -> None:
    found = _inspect(host, image["image_id"], expect)
    assert found is not None, (
        f"image {image['name']}: expected ImageID {image['image_id']} present, found absent"
    )
    assert found["Id"] == image["image_id"], f"ImageID: expected {image['image_id']}, found {found['Id']}"


def test_tag_points_at_image(host: Any, image: dict[str, Any], expect: dict[str, Any]) -> None:
    found = _inspect(host, image["tag"], expect)
    got = found["Id"] if found else "no such tag"
    assert got == image["image_id"], f"tag {image['tag']}: expected {image['image_id']}, found {got}"


def test_diff_ids(host: Any, image: dict[str, Any], expect: dict[str, Any]) -> None:
    found = _inspect(host, image["image_id"], expect)
    if found is None:
        pytest.skip("image absent (see image::present_by_id)")
    layers = found.get("RootFS", {}).get("Layers") or []
    want = image["diff_ids"]
    if layers != want:
        first = next(
            (i for i, (a, b) in enumerate(zip(want, layers, strict=False)) if a != b),
            min(len(want), len(layers)),
        )
        raise AssertionError(
            f"DiffIDs: expected {len(want)} layers, found {len(layers)}; first difference at layer "
            f"{first}: expected {want[first][:19] if first < len(want) else 'none'}, found "
            f"{layers[first][:19] if first < len(layers) else 'none'}"
        )


def test_labels(host: Any, image: dict[str, Any], expect: dict[str, Any]) -> None:
    want: dict[str, str] = or_skip(image.get("labels"), "the build record has no labels")
    found = _inspect(host, image["image_id"], expect)
    if found is None:
        pytest.skip("image absent (see image::present_by_id)")
    got = (found.get("Config") or {}).get("Labels") or {}
    bad = {k: (v, got.get(k)) for k, v in sorted(want.items()) if got.get(k) != v}
    if bad:
        k, (v, g) = next(iter(bad.items()))
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        raise AssertionError(f"label {k}: expected {v!r}, found {g!r}{more}")
