"""The conformance tier: every rank of the shipped vLLM lanes, as `builder launch` renders it, fed to a
real vLLM release from the package index (tests/lib/vllmconf.py: the release, its cached venv), to its
own CLI parser, serve validation and engine configuration, and each ``VLLM_*`` name of its environment
checked against the release's own list of environment variables (tests/lib/vllm_conformance.py: how,
and the two stand-ins it names: a GB10 platform stub and a stub model).

Stock vLLM must reject exactly the options of `FORK_ONLY` (each with the image that carries it) and
accept everything else: a misspelt flag, a dropped value or a renamed env name fails here, and a
fork-only option is never taken for a typo.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.lib import clirun, vllmconf

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]

#: option -> where it comes from: options the stock release does not know, carried by a lane's image
FORK_ONLY: dict[tuple[str, str | None], str] = {
    ("--quantization", "exl3"): "the Mia kit's image (vllm/vllm-openai:deepseekv41-flash-0909 with exllamav3 at "
                                "e648f1a1 built in; recipes.md §1.3); stock vLLM has no exl3 quantization",
}
#: the shipped vLLM lanes and the example fleet each runs on
LANES = {"vllm-native": "spark-tp4", "vllm-native-128k": "spark-tp4", "vllm-native-1m": "spark-tp4",
         "vllm-mia-tp2": "spark-tp2"}


def launch(fleet: str, lane: str) -> dict[str, Any]:
    p = clirun.run("launch", "--fleet", fleet, "--lane", lane, "--json", cwd=REPO,
                   env=clirun.environment(drop=("BUILDER_",)), timeout=120)
    assert p.returncode == 0, p.stderr
    out: dict[str, Any] = json.loads(p.stdout)
    return out


def engine_argv(h: dict[str, Any]) -> list[str]:
    """What follows ``vllm`` in the container: the entrypoint's rest and everything after the image."""
    argv = h["argv"]
    at = argv.index("--entrypoint")  # (builder renders: ... --entrypoint vllm IMAGE ARGS...)
    assert argv[at + 1] == "vllm"
    return argv[at + 3:]


def shipped_ranks() -> list[dict[str, Any]]:
    ranks = []
    for lane, fleet in LANES.items():
        for h in launch(fleet, lane)["hosts"]:
            ranks.append({"name": f"{lane}/r{h['rank']}", "argv": engine_argv(h), "env": h["env"]})
    return ranks


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    vllmconf.ensure_venv()
    ranks = shipped_ranks()
    return ranks, vllmconf.run_checker(ranks, list(FORK_ONLY), tmp_path_factory.mktemp("vllm-check"))


def test_the_release_is_the_pinned_one(checked: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    _, out = checked
    assert out["vllm"] == vllmconf.VLLM_RELEASE and out["platform"] == "GB10PlatformStub"


def test_stock_vllm_accepts_every_rank_but_the_listed_options(
    checked: tuple[list[dict[str, Any]], dict[str, Any]],
) -> None:
    ranks, out = checked
    assert [r["name"] for r in out["ranks"]] == [r["name"] for r in ranks]
    assert len(ranks) == 3 * 4 + 2
    for r, res in zip(ranks, out["ranks"], strict=True):
        assert res["accepted"], (r["name"], res["error"])
        assert res["env_unknown"] == [], r["name"]
        # each listed option the rank carries is refused by the stock release, and none is missing
        present = {f"{f} {v}" for f, v in FORK_ONLY if f in r["argv"] and r["argv"][r["argv"].index(f) + 1] == v}
        assert set(res["fork_only"]) == present, r["name"]
        for opt, why in res["fork_only"].items():
            assert why is not None, f"{r['name']}: vLLM {vllmconf.VLLM_RELEASE} takes {opt}: not fork-only"
    # the Mia lane's exl3 is the one fork-only option shipped, and it is refused on both ranks
    assert all("--quantization exl3" in res["fork_only"] for res in out["ranks"]
               if res["name"].startswith("vllm-mia"))


def test_a_misspelt_flag_and_a_changed_env_name_fail(
    checked: tuple[list[dict[str, Any]], dict[str, Any]], tmp_path: Path,
) -> None:
    ranks, _ = checked
    head = next(r for r in ranks if r["name"] == "vllm-native/r0")
    typo = dict(head, name="typo", argv=[a.replace("--max-num-batched-tokens", "--max-num-batch-tokens")
                                         for a in head["argv"]])
    env = dict(head["env"])
    env["VLLM_ENGINE_READY_TIMEOUT"] = env.pop("VLLM_ENGINE_READY_TIMEOUT_S")
    renamed = dict(head, name="renamed-env", env=env)
    bad_json = dict(head, name="bad-spec", argv=[a.replace('"draft_sample_method"', '"draft_sampling"')
                                                 for a in head["argv"]])
    bad_value = dict(head, name="bad-mode", argv=[a.replace("FULL_AND_PIECEWISE", "FULL_AND_PIECEWIZE")
                                                  for a in head["argv"]])
    bad_method = dict(head, name="bad-method", argv=[a.replace('"method":"dspark"', '"method":"dsparks"')
                                                     for a in head["argv"]])
    out = vllmconf.run_checker([typo, renamed, bad_json, bad_value, bad_method], list(FORK_ONLY), tmp_path)
    res = {r["name"]: r for r in out["ranks"]}
    assert not res["typo"]["accepted"] and "--max-num-batch-tokens" in res["typo"]["error"]
    assert res["renamed-env"]["accepted"] and res["renamed-env"]["env_unknown"] == ["VLLM_ENGINE_READY_TIMEOUT"]
    assert not res["bad-spec"]["accepted"] and "draft_sampling" in res["bad-spec"]["error"]
    assert not res["bad-mode"]["accepted"] and "FULL_AND_PIECEWIZE" in res["bad-mode"]["error"]
    assert not res["bad-method"]["accepted"] and "dsparks" in res["bad-method"]["error"]
