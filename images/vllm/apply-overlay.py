"""Place overlay files over the installed vllm package (runs inside the image build)."""

import hashlib
import os
import shutil
import sys

import vllm  # noqa: F401  (the base image must carry vllm)

pkg = os.path.dirname(sys.modules["vllm"].__file__)
listing, files = sys.argv[1], sys.argv[2]
for line in open(listing):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, target = line.split()
    dest = target if target.startswith("/") else os.path.join(pkg, target)
    if not os.path.exists(dest):
        sys.exit(f"overlay target does not exist in the base: {dest}")
    shutil.copyfile(os.path.join(files, name), dest)
    print(hashlib.sha256(open(dest, "rb").read()).hexdigest(), dest)
