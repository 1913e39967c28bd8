"""builder: reproducible, checkable lanes for DGX Spark clusters."""

__version__ = "0.1.0"

#: Version of the way builder assembles images, bundles and locks. Bumping it
#: changes every input address on purpose (like BuildKit's compatibility-version).
ASSEMBLY_FORMAT = 1
