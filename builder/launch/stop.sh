# stop.sh's body (builder/launch/stop.sh): `builder bundle` puts the rank's settings above it
# (LANE RANK and the labels LABEL_LANE LABEL_RANK). Stops and removes every container of this lane
# and rank, whatever bundle started it. Stop the head first.
ids=$(docker ps -aq --filter "label=$LABEL_LANE=$LANE" --filter "label=$LABEL_RANK=$RANK")
if [ -z "$ids" ]; then
    echo "stop.sh: nothing of lane $LANE rank $RANK is running" >&2
    exit 0
fi
# (word splitting wanted: one id per argument)
# shellcheck disable=SC2086
docker stop -t "${BUILDER_STOP_TIMEOUT:-30}" $ids >/dev/null
# shellcheck disable=SC2086
docker rm $ids >/dev/null
echo "stop.sh: stopped lane $LANE rank $RANK" >&2
