"""The standard-library core that the installer, the host scripts and every stage share: the rules that
must read the same on a host and on the operator's machine.

``canonjson`` (canonical JSON), ``atomic`` (atomic writes, the move of a finished folder into place,
fsync, and the one temp-naming scheme with its one cleaner), ``digest`` (a file's sha256 and the one
pool of hashing threads), ``fastmode`` (whether an apply record still vouches for a file's bytes),
``labels`` (the labels of a rank's container, and the filter that selects a lane's) and ``minisign``
(the minisign format, and its verification through openssl).

Standard library only, python3 >= 3.8 (as on DGX OS), importing nothing else of builder (an import
contract), because hosts run it without pip:

- the installer imports it, and ``install.pyz`` carries it beside the installer
  (``builder/core/`` and ``builder/installer/`` in one zipapp: builder.installer.pack);
- builder.foundation imports it (``canon`` and ``hashing`` re-export its names), and so the stages do;
- each host's audit pytest (checks/) imports what it needs of it, without the stages' models;
- a host script (builder.hostscripts) is sent as one source text and cannot import a package:
  ``derive`` keeps its own move of a folder into place, under the temp names of :mod:`.atomic`.
"""
