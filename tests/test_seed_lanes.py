"""The shipped seed lanes, rendered by `builder launch` on the shipped fleet files, against what each
rank of each seed's recipe runs (its launch scripts, as the recipes record them; the section numbers
below are the recipes').

Each expectation below cites the recipe fact it checks; the values come from the recipe, not from
builder's own rendering. Nothing is built or contacted: `builder launch` renders from the pins and
inventories alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.lib import clirun

REPO = Path(__file__).resolve().parents[1]


def launch(*args: str) -> dict[str, Any]:
    p = clirun.run("launch", *args, "--json", cwd=REPO, env=clirun.environment(drop=("BUILDER_",)), timeout=120)
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
    assert h["ready"] == {"kind": "running", "peer": True}  # a follower dials the head and opens no port


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


#: recipes.md §10.6, "Env, every rank" (graphs on, disk Engram on): name -> value
VLLM_ENV_10_6 = {
    "VLLM_ENGINE_READY_TIMEOUT_S": "3600", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800",
    "HF_HOME": "/cache/huggingface", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "TILELANG_CACHE_DIR": "/cache/tilelang", "TRITON_CACHE_DIR": "/cache/triton", "VLLM_USE_RUST_FRONTEND": "0",
    "VLLM_HAS_FLASHINFER_CUBIN": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "TORCH_CUDA_ARCH_LIST": "12.1a",
    "FLASHINFER_CUDA_ARCH_LIST": "12.1a", "FLASHINFER_DISABLE_VERSION_CHECK": "1", "MAX_JOBS": "2",
    "FLASHINFER_NVCC_THREADS": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_NET": "IB",
    "NCCL_IB_DISABLE": "0", "NCCL_IB_ROCE_VERSION_NUM": "2", "NCCL_IB_ADDR_FAMILY": "AF_INET", "NCCL_CROSS_NIC": "1",
    "NCCL_IB_MERGE_NICS": "0", "NCCL_IB_SUBNET_AWARE_ROUTING": "1", "NCCL_IB_TC": "106", "NCCL_NET_PLUGIN": "none",
    "NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0", "NCCL_IGNORE_CPU_AFFINITY": "1", "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "DSV41_ENGRAM_DISK": "1", "DSV41_ENGRAM_DISK_THREADS": "32",
    "DSV41_ENGRAM_DISK_CHUNK": "16",
}
#: §10.6 lanes: DSV41_LANE -> (builder lane, max-model-len, eager)
VLLM_LANES_10_6 = {"128k": ("vllm-native-128k", 131072, False), "300k": ("vllm-native", 300000, False),
                   "1m": ("vllm-native-1m", 1048576, True)}
VLLM_PKG = "/usr/local/lib/python3.12/dist-packages/vllm/"
#: §2.2: the seven boot-10 files, mounted over these paths of the package (all seven: disk Engram is on)
BOOT10_TARGETS = {VLLM_PKG + p for p in (
    "models/deepseek_v4_1/common/engram.py", "models/deepseek_v4_1/nvidia/model_state.py",
    "model_executor/model_loader/weight_utils.py", "models/deepseek_v4_1/attention.py",
    "models/deepseek_v4_1/nvidia/flashinfer_sparse.py", "v1/attention/backends/mla/sparse_swa.py",
    "model_executor/layers/sparse_attn_indexer.py")}


def option(c: list[str], flag: str) -> str:
    assert c.count(flag) == 1, (flag, c)
    return c[c.index(flag) + 1]


@pytest.mark.parametrize("dsv41_lane", sorted(VLLM_LANES_10_6))
def test_vllm_native_lanes_as_the_launcher_runs_them(dsv41_lane: str) -> None:
    """Each rank of each §10.6 lane, fact by fact: argv, env, container flags, mounts, order, memory prelude."""
    lane, max_len, eager = VLLM_LANES_10_6[dsv41_lane]
    out = launch("--fleet", "spark-tp4", "--lane", lane)
    assert out["lane"] == lane and out["start_timeout"] >= 11 * 60  # boot 10: 11 min to serving
    # order: stop every rank, head first; then each worker (headless) in rank order, then the head
    assert out["stop_order"][0] == "spark-a" and set(out["stop_order"]) == {"spark-a", "spark-b", "spark-c", "spark-d"}
    assert out["start"] == "workers-in-rank-order"
    assert out["start_order"] == ["spark-b", "spark-c", "spark-d", "spark-a"]
    k, seqs = 5, 8  # DSpark k = 5, --max-num-seqs 8
    sizes = sorted({m * i for m in (k, k + 1) for i in range(1, seqs + 1)})
    assert sizes == [5, 6, 10, 12, 15, 18, 20, 24, 25, 30, 35, 36, 40, 42, 48]  # the recipe's own list
    for r in range(4):
        h = rank(out, r)
        c = command(h)
        # serve arguments, every rank, in the launcher's order
        assert c[:3] == ["vllm", "serve", "/model"]
        assert option(c, "--served-model-name") == "deepseek-v4.1-flash"
        assert option(c, "--host") == "0.0.0.0" and option(c, "--port") == "8000"
        assert option(c, "--tensor-parallel-size") == "4" and option(c, "--pipeline-parallel-size") == "1"
        assert option(c, "--max-model-len") == str(max_len)
        assert option(c, "--max-num-seqs") == "8" and option(c, "--max-num-batched-tokens") == "8192"
        assert option(c, "--gpu-memory-utilization") == "0.80" and option(c, "--block-size") == "128"
        assert json.loads(option(c, "--engram-config")) == {"cpu_offload": False}
        assert json.loads(option(c, "--default-chat-template-kwargs")) == {"thinking": False}
        assert option(c, "--distributed-executor-backend") == "mp"
        assert json.loads(option(c, "--speculative-config")) == {
            "method": "dspark", "num_speculative_tokens": 5, "draft_sample_method": "probabilistic",
            "rejection_sample_method": "block", "enable_adaptive_verification": False}
        assert json.loads(option(c, "--limit-mm-per-prompt")) == {"image": 4}
        assert option(c, "--mm-processor-cache-gb") == "1"
        assert option(c, "--tool-call-parser") == "deepseek_v41" and option(c, "--reasoning-parser") == "deepseek_v41"
        assert "--enable-auto-tool-choice" in c
        if eager:
            assert "--enforce-eager" in c and "--compilation-config" not in c
        else:
            assert "--enforce-eager" not in c
            assert json.loads(option(c, "--compilation-config")) == {
                "cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": sizes}
        assert option(c, "--nnodes") == "4" and option(c, "--node-rank") == str(r)
        assert option(c, "--master-addr") == "192.0.2.110" and option(c, "--master-port") == "29541"
        assert ("--headless" in c) == (r > 0) and (r == 0 or c[-1] == "--headless")
        # the overlay image rejects --tokenizer-mode (only the day-0 *deepseekv41-flash-0909* images take it)
        assert "--tokenizer-mode" not in c
        order = [c.index(f) for f in ("--served-model-name", "--engram-config", "--speculative-config",
                                      "--limit-mm-per-prompt", "--tool-call-parser",
                                      "--enforce-eager" if eager else "--compilation-config", "--nnodes")]
        assert order == sorted(order)
        # env, every rank
        env = h["env"]
        for name, value in VLLM_ENV_10_6.items():
            assert env.get(name) == value, name
        assert env["VLLM_CACHE_ROOT"] == f"/cache/vllm-{dsv41_lane}"
        assert env.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == (None if eager else "1")  # graphs on only
        assert env["NCCL_IB_HCA"] == "rocep1s0f0" and env["NCCL_SOCKET_IFNAME"] == "enp1s0f0np0"
        assert env["GLOO_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"] == "enp1s0f0np0"
        # per rank (§10.4, §10.6)
        assert env["VLLM_HOST_IP"] == f"192.0.2.11{r}" and env["NODE_RANK"] == str(r)
        assert env["MASTER_ADDR"] == "192.0.2.110"
        # container
        argv = h["argv"]
        pairs = flag_pairs(argv)
        assert ("--gpus", "all") in pairs and ("--network", "host") in pairs and ("--ipc", "host") in pairs
        assert ("--cap-add", "IPC_LOCK") in pairs and ("--device", "/dev/infiniband") in pairs
        assert ("--ulimit", "memlock=-1:-1") in pairs and ("--ulimit", "nofile=65536:65536") in pairs
        assert option(argv, "--shm-size") == "32g" and option(argv, "--memory") == "112g"
        assert option(argv, "--memory-swap") == "112g" and option(argv, "--oom-score-adj") == "500"
        # mounts: weights at /model (ro), the cache folder at /cache (rw), each patch file read-only
        m = mounts(h)
        assert m["/model"] == ("/srv/models/dsv41-1017", False) and m["/cache"][1] is True
        assert {t for t, (_, w) in m.items() if t.startswith(VLLM_PKG) and not w} == BOOT10_TARGETS
        # before each rank: sync, drop the page cache, refuse below MIN_AVAIL_GB (100)
        assert h["min_available_gib"] == 100
    assert rank(out, 0)["ready"]["kind"] == "health" and rank(out, 1)["ready"] == {"kind": "running", "peer": True}
    # the image (a GB10 build) is not built here: its mount targets could not be checked, never "passed"
    assert out["mount_targets"]["state"] == "not run"
    # what §10.6 answers is not in the unknown list
    assert not any("300K" in u or "max-model-len" in u or "speculative" in u for u in out["unknown"])


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
    p = clirun.run("launch", "spark-tp4/spark-b", cwd=REPO, env=clirun.environment(drop=("BUILDER_",)), timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("docker run ")]
    assert len(lines) == 1 and "tf-dsv41-lanes" in lines[0] and "/srv/models/tp4-kit:/kit:ro" in lines[0]


def test_bad_requests_are_one_line_errors() -> None:
    env = clirun.environment(drop=("BUILDER_",))
    for args, needle in [(["--fleet", "nope"], "no fleet named 'nope'"),
                         (["--fleet", "spark-tp4", "--lane", "tensorfold-tp2"], "tensor_parallel = 2"),
                         ([], "name a HOST or --fleet")]:
        p = clirun.run("launch", *args, cwd=REPO, env=env, timeout=120)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
