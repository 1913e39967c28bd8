"""What every stage stands on: canonical JSON and atomic writes (canon), file and tree hashing
(hashing), the one way ssh is called (ssh), the Docker Engine adapter (dockerio, and the build through
it: dockerbuild), Ed25519 signing with minisign's format (sign) and the operator side's one registry
client (distribution, with its credentials in registryauth)."""
