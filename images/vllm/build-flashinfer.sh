#!/bin/sh
# overlay3 (recipes.md §1.3, §6, §12): FlashInfer 0.7.0rc1 at 07869c61 "with pinned submodules", built from source.
#   usage: build-flashinfer.sh FLASHINFER_TREE CONTEXT OUT   (in the build stage of images/vllm/Dockerfile)
#
# The recipe's build_overlay3.sh is UNKNOWN ("SHAs pinned inside"). builder exports a tree without its submodules,
# so each submodule FlashInfer's .gitmodules names (path 3rdparty/<name>) comes from a source pinned at the commit
# FlashInfer's tree records for it (`git ls-tree <flashinfer commit> 3rdparty/<name>`), named flashinfer-<name> and
# laid out at CONTEXT/src-flashinfer-<name>/. A submodule with no such source fails the build, naming it, unless its
# path is in FLASHINFER_SUBMODULES_UNUSED. The tree is then built into one wheel (no build isolation: the build has
# no network; the build backend's requirements must be in the base, which carries FlashInfer 0.6.18), which the
# image's overlay3 step installs with --no-deps.
# Environment: FLASHINFER_VERSION (the version the wheel must carry), FLASHINFER_SUBMODULES_UNUSED.
set -eu
tree=$1 ctx=$2 out=$3
die() { echo "build-flashinfer: $*" >&2; exit 1; }

want=${FLASHINFER_VERSION:-}
[ -n "$want" ] || die "FLASHINFER_VERSION build arg is empty"
[ -f "$tree/pyproject.toml" ] || die "$tree is not a FlashInfer tree (no pyproject.toml): is sources.flashinfer in images.vllm.sources?"

missing=""
if [ -f "$tree/.gitmodules" ]; then
    for p in $(sed -n 's/^[[:space:]]*path[[:space:]]*=[[:space:]]*//p' "$tree/.gitmodules"); do
        case "$p" in /*|*..*) die ".gitmodules names an unsafe path: $p" ;; esac
        n=${p##*/}
        src="$ctx/src-flashinfer-$n"
        if [ -d "$src" ]; then
            rm -rf "${tree:?}/$p"
            mkdir -p "$(dirname "$tree/$p")"
            cp -a "$src" "$tree/$p"
            echo "build-flashinfer: $p <- sources.flashinfer-$n"
        else
            case " ${FLASHINFER_SUBMODULES_UNUSED:-} " in
                *" $p "*) echo "build-flashinfer: $p left empty (FLASHINFER_SUBMODULES_UNUSED)" ;;
                *) missing="$missing $p" ;;
            esac
        fi
    done
fi
[ -z "$missing" ] || die "submodules with no pinned source:$missing; pin each as sources.flashinfer-<name> at the" \
    "commit the FlashInfer tree records for it and add it to images.vllm.sources"

mkdir -p "$out"
(cd "$tree" && python3 -m pip wheel --no-deps --no-build-isolation --no-index --wheel-dir "$out" .) \
    || die "pip wheel failed (its build requirements must be in the base image: the build has no network)"
set -- "$out"/*.whl
[ "$#" = 1 ] && [ -f "$1" ] || die "want one wheel in $out, found: $*"
whl=${1##*/}
ver=$(printf '%s' "$whl" | cut -d- -f2)
[ "${ver%%+*}" = "$want" ] || die "$whl is version $ver, not $want"
echo "build-flashinfer: $out/$whl"
