"""Per-host launch bundles: render, split into parts, hash, sign; verify a bundle folder.

A bundle is a folder (never one big tar) for one host's rank of a fleet:

    manifest.json            format, bundle id, host, fleet, lane, rank, world size, lock hash, image
                             (input address, ImageID, DiffIDs), every file (path, size, sha256, mode,
                             and its parts), the model files the host must hold (absolute path, size, sha256)
    manifest.json.minisig    minisign signature over manifest.json; its trusted comment carries
                             id, host, fleet, lane and rank
                             (`minisign -Vm manifest.json -p KEY.pub` checks it)
    start.sh stop.sh rank.env config.json   the rank's launch files (builder.launch)
    install.pyz              the installer: builder.installer as one zipapp (builder.bundle.hostpkg; run
                             only a verified copy, see builder/installer/__init__.py)
    image.tar                the image as a `docker load` archive (--with-image)
    models/<model>/<file>    model files (--with-models): hard links to the model store's objects
                             (builder.store.modelstore: a reflink where links are refused, a copy only
                             across file systems), never in parts, so a fleet holds them once
    parts/<path>.partNNNN    other files larger than --part-size (the image archive), in parts,
                             each hashed in the manifest

The bundle id is the sha256 of the canonical manifest without the id. No timestamps go anywhere and
modes are fixed, so the same lock, inventory and image give the same bytes (Ed25519 signatures are
deterministic too). Every file is streamed (4 MiB buffers): memory stays flat whatever the sizes.

Where each part lives: ``render`` (the inputs, what a rank holds, the manifest, the folder moved into
place: files only), ``make`` (the steps of `builder bundle`: the registry's preflight, rendering, then
the push to a fleet's registry), ``parts`` (the streaming part writer), ``archive``
(the image as a `docker load` archive), ``keys`` (the signing and trusted keys), ``verify``,
``hostpkg`` (install.pyz, the zipapp of builder.installer).
"""

from __future__ import annotations

from builder.bundle.keys import (
    SigningKeyChoice,
    choose_signing_key,
    describe_signing_key,
    keygen,
    public_key_for,
    read_public_key,
    signing_key_path,
)
from builder.bundle.make import make_bundle, make_fleet_bundles
from builder.bundle.parts import WrittenFile, write_bytes, write_stream
from builder.bundle.render import (
    BundleInputs,
    BundleOptions,
    BundleResult,
    RankLaunch,
    check_lane,
    launch_differs,
    launch_manifest,
    load_bundle_inputs,
    parse_size,
    rank_launch,
    render_bundle,
)
from builder.bundle.verifydir import crypto_sig_check, verify_dir, verify_with_key

__all__ = [
    "BundleInputs",
    "BundleOptions",
    "BundleResult",
    "RankLaunch",
    "SigningKeyChoice",
    "WrittenFile",
    "check_lane",
    "choose_signing_key",
    "crypto_sig_check",
    "describe_signing_key",
    "keygen",
    "launch_differs",
    "launch_manifest",
    "load_bundle_inputs",
    "make_bundle",
    "make_fleet_bundles",
    "parse_size",
    "public_key_for",
    "rank_launch",
    "read_public_key",
    "render_bundle",
    "signing_key_path",
    "verify_dir",
    "verify_with_key",
    "write_bytes",
    "write_stream",
]
