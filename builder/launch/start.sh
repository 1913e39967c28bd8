# start.sh's body (builder/launch/start.sh): `builder bundle` puts the rank's settings above it.
# Settings: LANE RANK ROLE NAME IMAGE ORDER MASTER_ADDR SERVE_PORT RDZV_PORT WORLD_SIZE START_TIMEOUT,
# MIN_AVAIL_GIB (the memory floor, GiB; empty for none; below it start.sh exits 4 as the vLLM launcher does),
# READY (this rank's readiness, JSON), BUNDLE_ID_TOKEN, the labels LABEL_LANE LABEL_RANK LABEL_BUNDLE,
# and the arrays NEED (host paths the mounts read: each must be there), MAKE (the lane's state folders,
# made here) and RUN (the rendered `docker run`, exactly as `builder launch` shows it).
here=$(cd "$(dirname "$0")" && pwd -P)
TIMEOUT=${BUILDER_START_TIMEOUT:-$START_TIMEOUT}
die() { echo "start.sh ($LANE rank $RANK): $*" >&2; exit 1; }
command -v docker >/dev/null || die "docker not found"
command -v python3 >/dev/null || die "python3 not found"
bundle_id=$(python3 "$here/lane.py" bundle-id "$here/manifest.json") || die "cannot read $here/manifest.json"
running=$(docker ps -q --filter "label=$LABEL_LANE=$LANE" --filter "label=$LABEL_RANK=$RANK")
if [ -n "$running" ]; then
    same=$(docker ps -q --filter "label=$LABEL_LANE=$LANE" --filter "label=$LABEL_RANK=$RANK" \
        --filter "label=$LABEL_BUNDLE=$bundle_id")
    if [ -n "$same" ] && [ "$same" = "$running" ]; then
        echo "start.sh: $NAME is already running this bundle (${bundle_id:0:16})" >&2
        exit 0
    fi
    die "an old container of lane $LANE rank $RANK is still running ($(echo $running | tr '\n' ' '));" \
        "run stop.sh first"
fi
if [ "$ORDER" != head-first ] && [ "$ROLE" = worker ] && \
        python3 "$here/lane.py" answers "$MASTER_ADDR" "$SERVE_PORT" "$RDZV_PORT"; then
    die "the head $MASTER_ADDR already answers (port $SERVE_PORT or $RDZV_PORT): an old head is still" \
        "running; stop it first (in this lane the workers start before the head)"
fi
docker image inspect "$IMAGE" >/dev/null 2>&1 || die "image $IMAGE is not loaded (install the bundle first)"
for path in "${NEED[@]}"; do
    [ -e "$path" ] || die "$path is missing (a mounted input of this rank: install the bundle, or make its derivation)"
done
if [ -n "$MIN_AVAIL_GIB" ]; then
    # the launcher's memory prelude: flush, drop the page cache, and refuse to start a rank that cannot fit
    sync
    if ! { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null; then
        echo "start.sh: cannot drop the page cache (not root); MemAvailable is read as it is" >&2
    fi
    avail_kib=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
    [ -n "$avail_kib" ] || die "cannot read MemAvailable from /proc/meminfo"
    if (( avail_kib / 1048576 < MIN_AVAIL_GIB )); then
        echo "start.sh ($LANE rank $RANK): MemAvailable is $(( avail_kib / 1048576 )) GiB, below the lane's" \
            "$MIN_AVAIL_GIB GiB: free memory first" >&2
        exit 4
    fi
fi
for dir in "${MAKE[@]}"; do
    mkdir -p "$dir" || die "cannot make $dir"
done
if docker container inspect "$NAME" >/dev/null 2>&1; then
    docker rm -v "$NAME" >/dev/null || die "cannot remove the stopped container $NAME"
fi
"${RUN[@]//"$BUNDLE_ID_TOKEN"/$bundle_id}" >/dev/null || die "docker run failed"
echo "start.sh: started $NAME (bundle ${bundle_id:0:16}, rank $RANK of $WORLD_SIZE); waiting until it is ready" >&2
why=$(python3 "$here/lane.py" wait "$NAME" "$READY" "$TIMEOUT" 2>&1) || die "rank $RANK is not ready: $why"
echo "start.sh: $NAME is ready" >&2
