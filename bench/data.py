"""The benchmarks' shared data: one model folder (>= 8 files), made once per run in the workdir."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.common import Config, GiB, MiB, warm, write_data_file
from builder.foundation.hashing import hash_folder_files


@dataclass
class ModelFolder:
    root: Path
    entries: list[tuple[str, int, str]]  # (relative path, size, sha256)

    @property
    def paths(self) -> list[Path]:
        return [self.root / e[0] for e in self.entries]

    @property
    def total(self) -> int:
        return sum(e[1] for e in self.entries)


_CACHE: dict[Path, ModelFolder] = {}


def model_folder(cfg: Config) -> ModelFolder:
    """8 safetensors-like files of incompressible data: 8 x 512 MiB = 4 GiB (--quick: 8 x 32 MiB).

    The expected sha256 of each file is computed here once with hashlib (the lock's role).
    """
    root = cfg.workdir / "model"
    if root in _CACHE:
        return _CACHE[root]
    each = 32 * MiB if cfg.quick else 512 * MiB
    names = [f"model-{i + 1:05d}-of-00008.safetensors" for i in range(8)]
    for i, n in enumerate(names):
        write_data_file(root / n, each, seed=i)
    mf = ModelFolder(root, [(n, size, digest) for n, digest, size in hash_folder_files(root, names, where="model")])
    assert mf.total >= (256 * MiB if cfg.quick else 4 * GiB)
    warm(mf.paths)
    _CACHE[root] = mf
    return mf
