# start.sh's body (builder/launch/start.sh): `builder bundle` puts the rank's settings above it.
# Settings: LANE RANK ROLE NAME IMAGE MASTER_ADDR SERVE_PORT RDZV_PORT WORLD_SIZE FLEET HOST CONFIG,
# the labels LABEL_LANE LABEL_RANK LABEL_BUNDLE LABEL_FLEET LABEL_HOST, RDMA (1: the host has RDMA
# devices), and the arrays PEERS (the workers, NAME=ADDRESS), MODEL_DIRS, RUN_OPTS and ARGS.
here=$(cd "$(dirname "$0")" && pwd -P)
TIMEOUT=${BUILDER_START_TIMEOUT:-600}
die() { echo "start.sh ($LANE rank $RANK): $*" >&2; exit 1; }
command -v docker >/dev/null || die "docker not found"
command -v python3 >/dev/null || die "python3 not found"
bundle_id=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["bundle_id"])' \
    "$here/manifest.json") || die "cannot read $here/manifest.json"
# answers HOST PORT...: exit 0 when any of the ports accepts a TCP connection
answers() {
    python3 - "$@" <<'PY'
import socket, sys
host = sys.argv[1]
for port in sys.argv[2:]:
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        sys.exit(0)
    except OSError:
        pass
sys.exit(1)
PY
}
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
if [ "$ROLE" = worker ] && answers "$MASTER_ADDR" "$SERVE_PORT" "$RDZV_PORT"; then
    die "the head $MASTER_ADDR already answers (port $SERVE_PORT or $RDZV_PORT): an old head is still" \
        "running; stop it first (workers start before the head)"
fi
docker image inspect "$IMAGE" >/dev/null 2>&1 || die "image $IMAGE is not loaded (install the bundle first)"
if [ "$ROLE" = head ]; then
    deadline=$(( $(date +%s) + TIMEOUT ))
    for peer in "${PEERS[@]}"; do
        pname=${peer%%=*}; paddr=${peer#*=}
        until answers "$paddr" "$SERVE_PORT" "$RDZV_PORT"; do
            [ "$(date +%s)" -lt "$deadline" ] || \
                die "worker $pname ($paddr) did not answer within $TIMEOUT s; start the workers first"
            sleep 1
        done
    done
fi
mounts=()
for dir in "${MODEL_DIRS[@]}"; do
    mounts+=(-v "$dir:$dir:ro")
    [ -d "$dir" ] || die "model folder $dir is missing"
done
if docker container inspect "$NAME" >/dev/null 2>&1; then
    docker rm "$NAME" >/dev/null || die "cannot remove the stopped container $NAME"
fi
extra=()
if [ "$RDMA" = 1 ] && [ -e /dev/infiniband ]; then
    extra+=(--device /dev/infiniband)
fi
# --init: the engine is not PID 1, so it gets the SIGTERM that `docker stop` sends (PID 1 ignores
# signals it has no handler for, and stop would wait its whole timeout before killing the rank)
docker run -d --init --name "$NAME" --network host --restart no \
    --label "$LABEL_LANE=$LANE" --label "$LABEL_RANK=$RANK" \
    --label "$LABEL_BUNDLE=$bundle_id" \
    --label "$LABEL_FLEET=$FLEET" --label "$LABEL_HOST=$HOST" \
    --env-file "$here/rank.env" -v "$here/config.json:$CONFIG:ro" \
    "${RUN_OPTS[@]}" "${extra[@]}" "${mounts[@]}" \
    "$IMAGE" "${ARGS[@]}"
echo "start.sh: started $NAME (bundle ${bundle_id:0:16}, rank $RANK of $WORLD_SIZE)" >&2
