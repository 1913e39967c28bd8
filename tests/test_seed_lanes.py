"""The shipped seed lanes, rendered by `builder launch` on the shipped fleet files, against what
../shared/reference/recipes.md §10 says each rank of each recipe runs.

Each expectation below cites the recipe fact it checks; the values come from the recipe, not from
builder's own rendering. Nothing is built or contacted: `builder launch` renders from the pins and
inventories alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def launch(*args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUILDER_")}
    p = subprocess.run([sys.executable, "-m", "builder", "launch", *args, "--json"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def rank(out: dict[str, Any], r: int) -> dict[str, Any]:
    return next(h for h in out["hosts"] if h["rank"] == r)


def command(h: dict[str, Any]) -> list[str]:
    """What the container runs: the --entrypoint, then everything after the image."""
    argv = h["argv"]
    i = argv.index("--entrypoint") if "--entrypoint" in argv else None
    entry = [argv[i + 1]] if i is not None else []
    return entry + argv[len(argv) - len(argv_after_image(h)):]


def argv_after_image(h: dict[str, Any]) -> list[str]:
    argv = h["argv"]
    image = next(a for a in argv if a.startswith("builder/") or a.startswith("sha256:") or "@" in a)
    return argv[argv.index(image) + 1:]


def mounts(h: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    return {m["target"]: (m["source"], m["writable"]) for m in h["mounts"]}


def flag_pairs(argv: list[str]) -> list[tuple[str, str]]:
    return [(argv[i], argv[i + 1]) for i in range(len(argv) - 1) if argv[i] in ("--ulimit", "--cap-add", "--gpus",
                                                                                "--ipc", "--device", "--network")]


@pytest.fixture(scope="module")
def tp4() -> dict[str, Any]:
    return launch("--fleet", "spark-tp4")


def test_tp4_start_order(tp4: dict[str, Any]) -> None:
    # §10.2: "Start order: ranks 3, 2 and 1 first, then rank 0."
    assert tp4["lane"] == "tensorfold-tp4" and tp4["start"] == "workers-first"
    assert tp4["start_order"] == ["spark-d", "spark-c", "spark-b", "spark-a"]


@pytest.mark.parametrize(("fleet", "lane", "ranks"), [
    ("spark-tp4", "tensorfold-tp4", [3, 2, 1, 0]),  # §10.2: ranks 3, 2 and 1 first, then rank 0
    ("spark-tp4", "vllm-native", [1, 2, 3, 0]),  # §10.6: each worker (ranks 1…N-1, headless), then the head
    ("spark-tp2", "tensorfold-tp2", [1, 0]),  # §10.3: rank 1 starts before rank 0
    ("spark-tp2", "tensorfold-python-tp2", [0, 1]),  # §10.3: rank 0 listening on its store port first
    ("spark-tp2", "vllm-mia-tp2", [1, 0]),  # §10.6: the worker, then the head
])
def test_every_seed_lane_starts_in_its_recipes_order(fleet: str, lane: str, ranks: list[int]) -> None:
    out = launch("--fleet", fleet, "--lane", lane)
    rank_of = {h["host"]: h["rank"] for h in out["hosts"]}
    assert [rank_of[n] for n in out["start_order"]] == ranks, out["start_order"]


def test_tp4_head_command_and_env(tp4: dict[str, Any]) -> None:
    h = rank(tp4, 0)
    # §10.2 / §11.1 (seed 000's values): tensorfold-native serve /model --host --port --name --context
    # --parallel $SERVER_FLAGS --backend cuda; 127.0.0.1:8001, deepseek-v4.1-flash, 1048576, 16
    assert command(h) == ["/engine/tensorfold-native", "serve", "/model", "--host", "127.0.0.1", "--port", "8001",
                          "--name", "deepseek-v4.1-flash", "--context", "1048576", "--parallel", "16",
                          "--no-thinking", "--max-tokens", "32768", "--backend", "cuda"]
    env = h["env"]
    want = {
        "TF_TP_WORLD": "4", "TF_TP_MASTER": "192.0.2.110", "TF_TP_PORT": "29760",
        "TF_DS_RANK_CACHE": "/cache/rank-cache", "TF_DS_KIT": "/kit", "TENSORFOLD_CUDA_KERNELS": "/kit/aot",
        "TF_DS_ENGRAM": "/engram", "TF_DS_TOKEN_MAP": "/cache/dsv41_token_map.json",
        "TF_DS_RDMA_KERNELS": "/engine/rdma_gather.fatbin",
        "TF_DS_GRAPHS": "1", "TF_DS_HC_SIDE": "1", "TF_DS_L2_PREFETCH": "1", "TF_DS_ENGRAM_AIO": "1",
        "TF_DS_2D_GU": "parity", "TF_DS_ROUND_ROWS": "48", "TF_DS_STREAMS": "16", "TF_DS_SERVED_K": "solo",
        "TF_DS_WINDOW": "2097152",
        # link env, all ranks: NCCL_IB_HCA and TF_RDMA_DEVICES are RDMA_HCA, NCCL_SOCKET_IFNAME is NET_IF
        "NCCL_IB_HCA": "rocep1s0f0", "TF_RDMA_DEVICES": "rocep1s0f0", "NCCL_SOCKET_IFNAME": "enp1s0f0np0",
        "NCCL_IB_GID_INDEX": "3",  # §11.1: seed 000 runs GID index 3
    }
    assert {k: env.get(k) for k in want} == want
    assert h["ready"] == {"kind": "health", "port": 8001, "path": "/health"}
    assert any("TF_DS_ROUND_MS" in u for u in tp4["unknown"])  # 48 measured values, not published


@pytest.mark.parametrize("r", [1, 2, 3])
def test_tp4_followers(tp4: dict[str, Any], r: int) -> None:
    h = rank(tp4, r)
    # §10.2: /engine/tf-dsv41-lanes /model /cache/rank-cache <g> 4 $MASTER_IP $TP_PORT /kit, then --pool
    # $CONTEXT --engram /engram --token-map /cache/dsv41_token_map.json --rdma $RDMA_HCA --rdma-kernels
    # /engine/rdma_gather.fatbin --graphs 1 --side 1 --prefetch 1 --aio 1 and $FOLLOW_FLAGS
    assert command(h) == [
        "/engine/tf-dsv41-lanes", "/model", "/cache/rank-cache", str(r), "4", "192.0.2.110", "29760", "/kit",
        "--pool", "1048576", "--engram", "/engram", "--token-map", "/cache/dsv41_token_map.json",
        "--rdma", "rocep1s0f0", "--rdma-kernels", "/engine/rdma_gather.fatbin",
        "--graphs", "1", "--side", "1", "--prefetch", "1", "--aio", "1",
        "--round-rows", "48", "--streams", "16", "--pool", "2097152", "--context", "1048576",
    ]
    env = h["env"]
    assert env["NCCL_IB_HCA"] == env["TF_RDMA_DEVICES"] == "rocep1s0f0"
    assert "TF_TP_MASTER" not in env  # followers take the rendezvous as arguments
    assert h["ready"] == {"kind": "running"}  # a follower dials the head and opens no port


@pytest.mark.parametrize("r", [0, 1, 2, 3])
def test_tp4_container(tp4: dict[str, Any], r: int) -> None:
    h = rank(tp4, r)
    pairs = flag_pairs(h["argv"])
    # §10.2 node_run.sh: --gpus all --network host --ipc host --ulimit memlock=-1 --ulimit stack=67108864
    # --cap-add IPC_LOCK, --device /dev/infiniband when present
    for p in [("--gpus", "all"), ("--network", "host"), ("--ipc", "host"), ("--ulimit", "memlock=-1"),
              ("--ulimit", "stack=67108864"), ("--cap-add", "IPC_LOCK"), ("--device", "/dev/infiniband")]:
        assert p in pairs, p
    m = mounts(h)
    # read-only KIT_DIR:/kit, MODEL_DIR:/model, ENGRAM_DIR:/engram; read-write CACHE_DIR:/cache, LOG_DIR:/logs
    assert m["/model"] == ("/srv/models/dsv41-1017-exl3-3-5bpw", False)
    assert m["/kit"] == ("/srv/models/tp4-kit", False)
    assert m["/engram"] == ("/nvme/engram/dsv41-1017-engram", False)
    # the rank cache: the derivation's folder, addressed by its inputs (not locked here: named so)
    assert m["/cache"] == ("/var/lib/builder/derived/rank-cache-(unlocked)", True)
    (d,) = h["derivations"]
    assert d["path"] == m["/cache"][0] and d["argv"][-6:-2] == ["/cache/rank-cache", str(r), "4", "--parity"]
    assert m["/logs"][1] is True
    assert "/engine" not in m  # builder bakes the engine into the image at /engine instead


def test_tp2_seed_003() -> None:
    out = launch("--fleet", "spark-tp2")
    assert out["lane"] == "tensorfold-tp2" and out["start_order"] == ["spark-worker", "spark-head"]
    head, worker = rank(out, 0), rank(out, 1)
    # seed 003: port 8888, model id DeepSeek-V4.1-Flash-1017, PARALLEL=4, CONTEXT=1048576, HOST 0.0.0.0
    c = command(head)
    assert c[:3] == ["/engine/tensorfold-native", "serve", "/model"]
    for flag, value in [("--host", "0.0.0.0"), ("--port", "8888"), ("--name", "DeepSeek-V4.1-Flash-1017"),
                        ("--context", "1048576"), ("--parallel", "4")]:
        assert c[c.index(flag) + 1] == value
    # §10.3: rank 1 runs tf-dsv41-lanes … 1 2 <HEAD_IP> 29620 <KIT> …
    assert command(worker)[:8] == ["/engine/tf-dsv41-lanes", "/model", "/cache/rank-cache", "1", "2",
                                   "198.51.100.110", "29620", "/kit"]
    # §10.3: both ranks NCCL_IB_GID_INDEX=5 TF_DS_REPLAY_FLOOR=1
    for h in (head, worker):
        assert h["env"]["NCCL_IB_GID_INDEX"] == "5" and h["env"]["TF_DS_REPLAY_FLOOR"] == "1"
        assert h["env"]["NCCL_IB_HCA"] == "rocep1s0f0,roceP2p1s0f0"  # both twin rails
    assert head["env"]["TF_TP_PORT"] == "29620" and head["env"]["TF_DS_KIT"] == "/kit"
    assert mounts(head)["/templates/chat_template.jinja"][0].endswith("/dsv41-1017-chat-template/UNKNOWN")


def test_vllm_native_seed_000() -> None:
    out = launch("--fleet", "spark-tp4", "--lane", "vllm-native")
    assert out["lane"] == "vllm-native" and out["start_timeout"] >= 11 * 60  # boot 10: 11 min to serving
    for r in range(4):
        h = rank(out, r)
        c = command(h)
        assert c[:3] == ["vllm", "serve", "/model"]
        # §10.4: NODE_RANK, VLLM_HOST_IP and --node-rank per rank, --headless on workers
        assert c[c.index("--node-rank") + 1] == str(r) and h["env"]["NODE_RANK"] == str(r)
        assert h["env"]["VLLM_HOST_IP"] == f"192.0.2.11{r}"
        assert ("--headless" in c) == (r > 0)
        assert c[c.index("--tensor-parallel-size") + 1] == "4"
        # §11.3: MASTER_PORT=29541, GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME
        assert c[c.index("--master-port") + 1] == "29541" and c[c.index("--master-addr") + 1] == "192.0.2.110"
        assert h["env"]["GLOO_SOCKET_IFNAME"] == "enp1s0f0np0"
        # §2.2: seven boot-10 files bind-mounted read-only over the vllm package
        pkg = "/usr/local/lib/python3.12/dist-packages/vllm/"
        over = {t for t, (_, w) in mounts(h).items() if t.startswith(pkg) and not w}
        assert over == {pkg + p for p in (
            "models/deepseek_v4_1/common/engram.py", "models/deepseek_v4_1/nvidia/model_state.py",
            "model_executor/model_loader/weight_utils.py", "models/deepseek_v4_1/attention.py",
            "models/deepseek_v4_1/nvidia/flashinfer_sparse.py", "v1/attention/backends/mla/sparse_swa.py",
            "model_executor/layers/sparse_attn_indexer.py")}
    assert rank(out, 0)["ready"]["kind"] == "health" and rank(out, 1)["ready"] == {"kind": "running"}


def test_python_engine_starts_rank_0_first() -> None:
    out = launch("--fleet", "spark-tp2", "--lane", "tensorfold-python-tp2")
    # §10.3: rank 0 must be listening on the store port (29551) before rank 1 starts
    assert out["start"] == "head-first" and out["start_order"] == ["spark-head", "spark-worker"]
    head, worker = rank(out, 0), rank(out, 1)
    assert head["ready"] == {"kind": "port", "port": 29551}
    for h in (head, worker):
        # seed 002: TF_DSV41_BIAS_VL=/model on both ranks; §6: the JIT caches persisted
        assert h["env"]["TF_DSV41_BIAS_VL"] == "/model" and h["env"]["MASTER_PORT"] == "29551"
        assert h["env"]["TENSORFOLD_NO_UPDATE_CHECK"] == "1" and h["env"]["HF_HUB_OFFLINE"] == "1"
        assert mounts(h)["/engram"][0] == "/var/lib/builder/derived/engram-packed-(unlocked)"
        # §10.5: each rank packs its own engram-l1/l14-r{rank}of2.bin from shards 47 and 48
        (d,) = h["derivations"]
        assert d["argv"][-4:] == ["--rank", str(h["rank"]), "--tp", "2"]
    assert any("cluster.py" in u for u in out["unknown"])


def test_vllm_profile_by_published_digest_is_named_unknown() -> None:
    out = launch("--fleet", "spark-tp2", "--lane", "vllm-mia-tp2")
    assert out["image"]["state"] == "published" and out["image"]["ref"].endswith("@UNKNOWN")
    assert rank(out, 1)["argv"][-1] == "--headless"
    assert rank(out, 0)["env"]["NCCL_PROTO"] == "^LL128"  # §11.4 Mia kit .env


def test_text_form_is_the_same_argv(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUILDER_")}
    p = subprocess.run([sys.executable, "-m", "builder", "launch", "spark-tp4/spark-b"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("docker run ")]
    assert len(lines) == 1 and "tf-dsv41-lanes" in lines[0] and "/srv/models/tp4-kit:/kit:ro" in lines[0]


def test_bad_requests_are_one_line_errors() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUILDER_")}
    for args, needle in [(["--fleet", "nope"], "no fleet named 'nope'"),
                         (["--fleet", "spark-tp4", "--lane", "tensorfold-tp2"], "tensor_parallel = 2"),
                         ([], "name a HOST or --fleet")]:
        p = subprocess.run([sys.executable, "-m", "builder", "launch", *args], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
