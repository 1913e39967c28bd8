#!/bin/sh
# Capture a GPU host in four states, with nvidia-smi and NVML, and run builder's burn there:
#   sh docs/h200-gpu-states.sh OUTDIR [audit]
# 1 idle; 2 busy with a foreign process (a bf16 8192² matmul holding 100 GiB, plain environment);
# 3 busy with the lane's own process (the same load with the BUILDER_* variables a rank's container has);
# 4 the burn: builder.hostscripts.burnload running the fp16 4096² matmul (builder.hostscripts.matmul) and sampling,
#   between two runs of the same matmul timed on its own; with `audit`, `--only burn`, then the GPU checks
#   during a second burn (state `burning`).
# Each state writes STATE-query.txt (builder.gpu.QUERY_FIELDS), STATE-sample.txt (builder.gpu.burn.SAMPLE_FIELDS),
# STATE-apps.txt, STATE-nvml.json and, with a load, STATE-procs.json (builder.hostscripts.gpuprocs);
# with `audit`, STATE-audit.json and STATE-audit.txt (builder audit --fleet h200-local, exit status in the file).
# Needs python3 with torch and nvidia-ml-py; pydantic and testinfra from wheels under .cache/whl if missing.
set -u
out=${1:?usage: h200-gpu-states.sh OUTDIR [audit]}
audit=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
if ! python3 -c 'import pydantic, testinfra' 2>/dev/null && ls .cache/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .cache/whl/*.whl || exit 1
  PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH PYTHONUNBUFFERED=1

query=$(python3 -c 'from builder.gpu import QUERY_FIELDS as f; print(",".join(f))') || exit 1
sample=$(python3 -c 'from builder.gpu.burn import SAMPLE_FIELDS as f; print(",".join(f))') || exit 1
smi=${NVIDIA_SMI:-nvidia-smi}
only=${AUDIT_ONLY:-gpu,memory,storage,fabric,runtime,burn}

{ date -u +%Y-%m-%dT%H:%M:%SZ; uname -r; $smi --version; python3 -c 'import torch; print("torch", torch.__version__)'; } \
  >"$out/env.txt" 2>&1

capture() {  # capture STATE [PID...]
  st=$1; shift
  $smi --query-gpu="$query" --format=csv,noheader,nounits >"$out/$st-query.txt" 2>&1
  $smi --query-gpu="$sample" --format=csv,noheader,nounits >"$out/$st-sample.txt" 2>&1
  $smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits >"$out/$st-apps.txt" 2>&1
  python3 docs/h200-nvml-snapshot.py >"$out/$st-nvml.json" 2>&1
  pids=$(cut -d, -f1 "$out/$st-apps.txt" | tr -dc '0-9\n' | paste -sd, -)
  if [ -n "$pids" ]; then
    python3 -I -S builder/hostscripts/gpuprocs.py "{\"pids\": [$pids]}" >"$out/$st-procs.json" 2>&1
  fi
  if [ -n "$audit" ]; then
    python3 -m builder audit --fleet h200-local --only "$only" --json >"$out/$st-audit.json" 2>"$out/$st-audit.txt"
    echo "exit $?" >>"$out/$st-audit.txt"
  fi
  echo "$st: $(cat "$out/$st-sample.txt")"
}

busy() {  # busy STATE [NAME=VALUE...]: capture while a 100 GiB bf16 load runs, in that environment
  st=$1; shift
  env "$@" python3 builder/hostscripts/matmul.py '{"seconds": 60, "size": 8192, "dtype": "bf16", "hold_gib": 100}' \
    >"$out/$st-load.json" 2>&1 &
  load=$!
  n=0  # wait for the load to show among the compute processes, then for it to be running flat out
  while [ $n -lt 60 ] && ! $smi --query-compute-apps=pid --format=csv,noheader | grep -q .; do sleep 0.5; n=$((n + 1)); done
  sleep 3
  capture "$st"
  kill "$load" 2>/dev/null
  wait "$load" 2>/dev/null
  sleep 2
}

echo "drop_caches: $(sync; echo 3 2>&1 >/proc/sys/vm/drop_caches && echo ok)" >>"$out/env.txt"
capture idle
busy foreign
busy own BUILDER_LANE=demo BUILDER_FLEET=h200-local BUILDER_HOST=h200 BUILDER_RANK=0

# 4: the matmul on its own, the burn (the same matmul under builder's sampler), the matmul on its own again
mm='{"seconds": 12, "size": 4096, "dtype": "fp16"}'
python3 builder/hostscripts/matmul.py "$mm" >"$out/alone-1.json" 2>&1
req=$(python3 -c 'import json, sys
from builder.gpu.burn import sample_command
print(json.dumps({"command": ["python3", "builder/hostscripts/matmul.py", sys.argv[1]], "timeout": 60,
                  "interval": 0.5, "query": sample_command()}))' "$mm")
python3 -I -S builder/hostscripts/burnload.py "$req" >"$out/burn-facts.json" 2>&1
python3 builder/hostscripts/matmul.py "$mm" >"$out/alone-2.json" 2>&1
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
from builder.gpu.burn import BANDS, judge
out = Path(sys.argv[1])
facts = json.loads((out / "burn-facts.json").read_text())
res = judge(facts, BANDS["NVIDIA H200"])
alone = [json.loads((out / f"alone-{i}.json").read_text().strip().splitlines()[-1]) for i in (1, 2)]
doc = {"burn": res.to_json(), "alone": alone}
(out / "burn-judged.json").write_text(json.dumps(doc, indent=1) + "\n")
print(json.dumps(doc, indent=1))
EOF
if [ -n "$audit" ]; then  # the burn through the audit, the GPU free
  python3 -m builder audit --fleet h200-local --only burn --json >"$out/burn-audit.json" 2>"$out/burn-audit.txt"
  echo "exit $?" >>"$out/burn-audit.txt"
  # the GPU checks during a burn (a second one, so the timed burn above is undisturbed): the load is
  # builder's, run by hand, so it is a process outside the lane, as another operator's burn would be
  python3 -I -S builder/hostscripts/burnload.py "$req" >"$out/burning-facts.json" 2>&1 &
  bp=$!
  sleep 9
  keep=$only; only=gpu; capture burning; only=$keep
  wait "$bp"
fi
echo done
