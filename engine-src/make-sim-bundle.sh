#!/usr/bin/env bash
# Regenerate engine-src/sim-engine.bundle from engine-src/sim-engine/ (the SIMULATOR engine).
#
# The bundle is a real git repository on branch main with one commit and the tag v0.1.0. Authors,
# dates and config are fixed, so the same source gives the same commit (and the same bundle bytes)
# on any machine. `builder lock` clones it over file://, like any other git source. Every file of
# the plain source folder is committed except zig-out/ and .zig-cache/.
#
# usage: engine-src/make-sim-bundle.sh [--check]     --check: fail if the committed bundle is stale
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$here/sim-engine"
bundle="$here/sim-engine.bundle"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# A sealed git: no user or system config, fixed identity and dates.
export HOME="$work/home" GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null
export GIT_AUTHOR_NAME="sim-engine" GIT_AUTHOR_EMAIL="sim-engine@example.invalid"
export GIT_COMMITTER_NAME="sim-engine" GIT_COMMITTER_EMAIL="sim-engine@example.invalid"
export GIT_AUTHOR_DATE="2025-02-01T00:00:00Z" GIT_COMMITTER_DATE="2025-02-01T00:00:00Z"
export TZ=UTC LC_ALL=C
mkdir -p "$HOME"
g() { git -C "$work/repo" -c core.autocrlf=false -c core.fileMode=true -c pack.threads=1 \
        -c commit.gpgSign=false -c tag.gpgSign=false "$@"; }

git init -q -b main "$work/repo"
# The plain source folder, with normalized modes, in a fixed order.
(cd "$src" && find . -type f ! -path './zig-out/*' ! -path './.zig-cache/*' -print | sed 's|^\./||' | sort) > "$work/files"
[[ -s "$work/files" ]] || { echo "make-sim-bundle: no files in $src" >&2; exit 1; }
while IFS= read -r rel; do
  mkdir -p "$(dirname "$work/repo/$rel")"
  install -m 0644 "$src/$rel" "$work/repo/$rel"
done < "$work/files"
g add -A
g commit -q -m "sim-engine: a simulator of the seed lanes' engines (TensorFold, vLLM, pack_engram.py)"
g tag -a v0.1.0 -m "sim-engine 0.1.0"

g bundle create "$work/sim-engine.bundle" HEAD main v0.1.0 2>/dev/null
git bundle verify "$work/sim-engine.bundle" >/dev/null 2>&1

if [[ "${1:-}" == "--check" ]]; then
  cmp -s "$work/sim-engine.bundle" "$bundle" || { echo "make-sim-bundle: $bundle is stale" >&2; exit 1; }
  echo "up to date: main $(g rev-parse main)"
  exit 0
fi

install -m 0644 "$work/sim-engine.bundle" "$bundle.tmp" && mv "$bundle.tmp" "$bundle"
echo "wrote $bundle (main $(g rev-parse main), tag v0.1.0)"
