"""``builder image`` and ``builder push``: the locked closure of an image (plan), its hermetic,
reproducible build (build, layers), its record, provenance and SBOM, the mounts it must hold
(mounttargets), the push to a registry (registry) and the store's gc by what the plans refer to."""
