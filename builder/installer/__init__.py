"""builder's host side: verify a bundle, stage it as a release, switch atomically, roll back.

Standard library only (no third-party imports, nothing of builder but builder.core, the
standard-library core it shares with the operator side; python3 >= 3.8 as on DGX OS): a host needs
only python3, docker and openssl (OpenSSL 3.0 or newer, for Ed25519). The operator side imports these
same modules as a library (builder.bundle, builder.ship, builder.deploy).

One module per concern: ``errors`` (InstallError, exit codes), ``manifest`` (format, names, the
structure and path rules, the bundle id), ``files`` (a regular file's sha256, writeback, reads with a
limit, the walk of a bundle folder), ``verify`` (a bundle folder against its signed manifest, through
builder.core.minisign), ``engine`` (docker load, pull, thin archives), ``blobs``
(model files pulled from the fleet registry by digest), ``root``
(links, lock, temps, free disk), ``record`` (the apply record), ``release`` (stage,
switch, rollback, status), ``install`` (a bundle folder), ``receive`` (ship's stream), ``pack``
(the zipapp), ``commands``. Atomic writes, temp names, the move into place, sha256, the pool of
hashing threads and fast mode's rule are builder.core's.

How it reaches a host: as ``install.pyz``, one zipapp of this package and builder.core made by
``pack`` (fixed timestamps, order and modes: the same source gives the same bytes), run as
``python3 install.pyz COMMAND ...``.

- ``builder ship HOST`` and ``builder deploy`` keep this machine's trusted copy on the host as
  ``ROOT/incoming/install-<sha256[:16]>.pyz``: each command that runs it carries it at the head of
  its stdin, writes it there only when the host's copy is missing or differs, and runs it only
  once its sha256 is the one sent. The copy in a bundle is never run by ship or deploy.
- A bundle also carries it as ``install.pyz``. The FIRST install on a sneakernet host should use
  the operator's copy (``python3 -m builder.bundle.hostpkg install.pyz``, or
  ``python3 -m builder.installer assemble > install.pyz``, writes it): never run code
  from a bundle that has not been verified. Later installs may run the ``install.pyz`` of the
  current release (``<root>/current/install.pyz``), which was verified when it was installed.

Commands::

    install BUNDLE_DIR --root ROOT [--trusted-key FILE | --trusted-key-base64 LINE] [--insecure]
            [--host NAME] [--remove-source] [--reserve BYTES]
            [--stage] [--rehash]
            (--rehash: every placed file is hashed, none vouched for by a record's size, mtime and
            inode, so a file changed in place is placed again: builder deploy --repair)
            (--remove-source, for a folder under ROOT/incoming: its model files are linked into
            place where that is a move, see install._link_whole; otherwise each is copied)
    stage --root ROOT --release BUNDLE_ID   (stage a release already under releases/)
    switch --root ROOT --to BUNDLE_ID [--rollback]
    rollback --root ROOT
    status --root ROOT
    receive --root ROOT [install's key, host, --stage, --rehash and --reserve options]
                             (builder ship: the bundle streamed on stdin, each byte hashed as it
                             arrives, then installed; see "receive" below)
    inventory DIR            (sizes and sha256 of the files under DIR)
    assemble                 (print this installer as install.pyz)

Layout under ROOT (a host's ``paths.bundles``)::

    trusted.pub                 the fleet's minisign public key (set at the first install)
    releases/<bundle_id>/       installed releases (launch files, manifest, signature, install.pyz)
    releases/.tmp-*             staging (removed at the next start; never a release)
    current -> releases/<id>    switched with symlink + rename (atomic)
    previous -> releases/<id>   what ``rollback`` returns to
    staged -> releases/<id>     what ``install --stage`` or ``stage`` made ready (``builder deploy``)
    state/applied.json          the apply record (see APPLY RECORD below), written atomically
    state/staged.json           the record the staged release will have once switched (action "stage")
    state/install.lock          flock: two installs never interleave
    incoming/<bundle_id>/       where ``builder ship`` copies a bundle
    incoming/install-<sha>.pyz  the operator's installer, kept by its sha256 (ship, deploy)

Order of an install: signature (against ROOT/trusted.pub; ``--insecure`` must be explicit to skip),
then every hash (extra, missing or changed files; ``..``, absolute paths, links and device files are
refused), then free disk, then: load the image if its ID is not present (the loaded ID must equal the
manifest's; a bundle of a fleet with a registry names the image by digest in ``image.pull`` instead of
carrying it, and ``docker pull`` fetches only the layers the host lacks; a thin archive,
``image.omitted_layers``, is refused unless the host holds the layers it leaves out), place bundled
model files atomically (those a manifest names by their blob in the fleet registry, ``models[].registry``,
pulled first by ``blobs``, each checked against its sha256), stage the release, switch ``current``, keep the old
one as ``previous``, write the apply record. A SIGKILL at any point leaves ``current`` on a complete
release (the old one until the switch) and a rerun completes. A rerun of the installed bundle changes
nothing.

Stage, then switch (``builder deploy``: every host staged and audited before any host switches):
``install --stage`` does everything an install does up to the switch, then points ``staged`` at the
release and writes ``state/staged.json`` (the apply record the release will have, so the audit can
check the staged release before it runs); ``current`` and ``state/applied.json`` are not touched.
``stage --release ID`` does the same for a release already under ``releases/`` (its files, image and
model files checked again). ``switch --to ID`` makes any complete release current (``previous`` :=
the old current), writes the apply record (action ``install``, or ``rollback`` with ``--rollback``)
and clears ``staged`` when it named that release.

APPLY RECORD (state/applied.json, format 1)::

    {format, action ("install" | "rollback" | "stage"), bundle_id, host, fleet, lane, rank, role, world_size,
     lock_hash, image: {name, input_address, image_id, diff_ids}, manifest_sha256, applied_at (UTC,
     ISO 8601, the one non-deterministic field), previous_bundle_id (or null), release (its folder),
     files: [{path, size, sha256}] (the release's files), models: [{path, size, sha256, mtime (ns),
     inode}]}

Exit codes: 0 done (or nothing to do), 1 verification or the work failed, 2 usage or configuration.
"""
