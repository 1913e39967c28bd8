"""The checks after images/tensorfold-python's pip installs (runs in the image build, with the base's python).

    python check-install.py SOURCE_TREE TORCH_VERSION_FILE      (environment: TF_VERSION, TF_FAMILY)

- torch's version is the one recorded before any pip install (jayleaton's Python image asserts it; recipes.md §6, §13);
- the installed engine reports TF_VERSION;
- the lane's model family (``tensorfold.families.<TF_FAMILY>``) imports, and every kernel source it has in the tree
  (.cu .cuh .cpp .h .hpp under ``families/<TF_FAMILY>/``) is in the installed package: jayleaton checks five such
  files by name (jayleaton/deepseek-v41-tensorfold-spark@d3eed414 docker/Dockerfile); this checks all of them.
"""

import importlib
import os
import pathlib
import sys

KERNEL_SUFFIXES = {".cu", ".cuh", ".cpp", ".h", ".hpp"}


def main(tree: pathlib.Path, torch_version_file: pathlib.Path) -> str | None:
    import tensorfold
    import torch
    import triton

    was = torch_version_file.read_text().strip()
    if torch.__version__ != was:
        return f"torch changed in the pip installs: {torch.__version__}, was {was}"
    want, family = os.environ.get("TF_VERSION", ""), os.environ.get("TF_FAMILY", "")
    if not want or not family:
        return "TF_VERSION and TF_FAMILY must be set (build arguments)"
    if tensorfold.__version__ != want:
        return f"tensorfold is {tensorfold.__version__}, not {want}"
    try:
        fam = importlib.import_module(f"tensorfold.families.{family}")
    except ImportError as e:
        return (f"tensorfold.families.{family} does not import ({e}): this TensorFold does not serve the lane's "
                "model (seed 002's DeepSeek family comes with its patch series)")
    installed = pathlib.Path(fam.__file__).parent
    # pip builds in the tree (build/lib/ holds a copy): the source is the one outside build/
    trees = sorted(p for p in tree.rglob(family)
                   if p.is_dir() and p.parent.name == "families" and p.relative_to(tree).parts[0] != "build")
    if len(trees) != 1:
        return f"want one families/{family} folder in {tree}, found {[str(t) for t in trees]}"
    kernels = sorted(p.relative_to(trees[0]) for p in trees[0].rglob("*")
                     if p.is_file() and p.suffix in KERNEL_SUFFIXES)
    missing = [str(k) for k in kernels if not (installed / k).is_file()]
    if missing:
        return f"kernel sources missing from the installed package: {missing}"
    print("tensorfold", tensorfold.__version__, fam.__file__, f"({len(kernels)} kernel sources)",
          "torch", torch.__version__, "triton", triton.__version__)
    return None


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: check-install.py SOURCE_TREE TORCH_VERSION_FILE")
    sys.exit(main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])))
