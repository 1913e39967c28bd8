#!/bin/sh
# Capture nvidia-smi on a GPU host and parse it with builder.gpu from this working tree.
#   sh docs/h200-probe.sh OUTDIR
# Writes OUTDIR/h200-live-{query,version,apps,summary,fallback}.txt (raw nvidia-smi output)
# and OUTDIR/h200-live-report.json (builder.gpu.probe_local() as JSON). Needs python3 with
# pydantic; without it, wheels under .cache/whl (see docs/h200-run.md) go to /tmp/site.
set -u
out=${1:?usage: h200-probe.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
if ! python3 -c 'import pydantic' 2>/dev/null && ls .cache/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .cache/whl/*.whl || exit 1
  PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH

fields=$(python3 -c 'from builder.gpu import QUERY_FIELDS as f; print(",".join(f))') || exit 1
fallback=$(python3 -c 'from builder.gpu import FALLBACK_FIELDS as f; print(",".join(f))') || exit 1
nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits >"$out/h200-live-query.txt" 2>&1
echo "query rc=$?"
nvidia-smi --query-gpu="$fallback" --format=csv,noheader,nounits >"$out/h200-live-fallback.txt" 2>&1
echo "fallback rc=$?"
nvidia-smi --version >"$out/h200-live-version.txt" 2>&1
echo "version rc=$?"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits \
  >"$out/h200-live-apps.txt" 2>&1
echo "apps rc=$?"
nvidia-smi >"$out/h200-live-summary.txt" 2>&1
echo "summary rc=$?"

python3 - "$out" <<'EOF'
import json, sys, time
from pathlib import Path
from builder import gpu

out = Path(sys.argv[1])
t = time.monotonic()
report = gpu.probe_local()
elapsed = time.monotonic() - t
doc = {
    "report": report.model_dump(),
    "event_reasons": {g.index: gpu.decode_event_reasons(g.event_reasons or 0) for g in report.gpus},
    "throttled": {g.index: g.throttled for g in report.gpus},
    "probe_wall_s": round(elapsed, 3),
    # the raw captures parse the same way
    "raw_query": [g.model_dump() for g in gpu.parse_query((out / "h200-live-query.txt").read_text())],
    "raw_fallback": [g.model_dump() for g in
                     gpu.parse_query((out / "h200-live-fallback.txt").read_text(), gpu.FALLBACK_FIELDS)],
    "raw_version": gpu.parse_version((out / "h200-live-version.txt").read_text()),
    "raw_summary_version": gpu.parse_version((out / "h200-live-summary.txt").read_text()),
    "raw_apps": [a.model_dump() for a in gpu.parse_compute_apps((out / "h200-live-apps.txt").read_text())],
}
text = json.dumps(doc, indent=2, sort_keys=True)
(out / "h200-live-report.json").write_text(text + "\n")
print(text)
EOF
