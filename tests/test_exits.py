"""builder.audit.exits: the rank whose engine exited first is the cause, the others its consequences."""

from __future__ import annotations

from builder.audit.exits import EXIT_CHECK, RankExit, cause_and_consequences, finished_ns, name_the_cause
from builder.audit.findings import AuditReport, CheckOutcome, HostResult
from builder.deploy.status import FleetStatus, HostStatus
from builder.deploy.status import name_the_cause as status_cause


def test_docker_times_compare_as_times_not_text() -> None:
    # RFC 3339 with trailing zeros dropped: as text ".1Z" sorts after ".12Z"
    assert finished_ns("2026-12-04T16:41:32.1Z") == finished_ns("2026-12-04T16:41:32.100000000Z")
    assert finished_ns("2026-12-04T16:41:32.1Z") < finished_ns("2026-12-04T16:41:32.12Z")  # type: ignore[operator]
    assert finished_ns("2026-12-04T17:41:32+01:00") == finished_ns("2026-12-04T16:41:32Z")
    assert finished_ns("0001-01-01T00:00:00Z") is None and finished_ns("") is None


def test_the_first_to_finish_is_the_cause() -> None:
    exits = [RankExit("a", 0, 1, "2026-12-04T16:41:32.3Z"), RankExit("c", 2, 137, "2026-12-04T16:41:32.1Z", "x"),
             RankExit("b", 1, 1, "2026-12-04T16:41:32.25Z"), RankExit("d", 3, None, "")]
    got = cause_and_consequences(exits)
    assert got is not None and (got["host"], got["rank"], got["exit_code"], got["log"]) == ("c", 2, 137, "x")
    assert [e["host"] for e in got["consequences"]] == ["b", "a", "d"]  # (a time it cannot read goes last)
    assert cause_and_consequences([]) is None


def test_of_exits_at_once_the_one_killed_by_a_signal_is_the_cause() -> None:
    # as on the simulator fleet: the follower that lost the head is stamped before the SIGKILLed worker
    exits = [RankExit("w1", 1, 1, "2026-12-04T16:53:15.647038406Z"),
             RankExit("w2", 2, 137, "2026-12-04T16:53:15.656412854Z"),
             RankExit("h0", 0, 1, "2026-12-04T16:53:15.662715038Z")]
    got = cause_and_consequences(exits)
    assert got is not None and got["host"] == "w2" and [e["host"] for e in got["consequences"]] == ["w1", "h0"]
    # a loaded host stamps late, or its clock is behind: within five seconds is still at once
    late = [RankExit("w1", 1, 1, "2026-12-04T16:53:11.0Z"), RankExit("w2", 2, 139, "2026-12-04T16:53:15.6Z")]
    assert cause_and_consequences(late)["host"] == "w2"  # type: ignore[index]
    # more than five seconds apart is not at once: the earlier is the cause, whatever its exit code
    later = [RankExit("w1", 1, 1, "2026-12-04T16:53:10.5Z"), RankExit("w2", 2, 137, "2026-12-04T16:53:15.6Z")]
    assert cause_and_consequences(later)["host"] == "w1"  # type: ignore[index]


def test_an_abort_after_a_lost_peer_is_not_the_cause_s_mark() -> None:
    exits = [RankExit("h0", 0, 1, "2026-12-04T16:53:15.1Z"), RankExit("w1", 1, 134, "2026-12-04T16:53:15.4Z")]
    assert cause_and_consequences(exits)["host"] == "h0"  # type: ignore[index]


def _host(name: str, rank: int, when: str, code: int) -> HostResult:
    fact = {"rank": rank, "exit_code": code, "finished_at": when, "log": f"log of {rank}"}
    return HostResult(name, "f", "drift", checks=[
        CheckOutcome("serving::health", "serving", "fail", "/health: expected HTTP 200, found refused"),
        CheckOutcome(EXIT_CHECK, "serving", "fail", "exited", {"exit": fact}),
    ])


def test_the_audit_names_the_cause_first_on_its_host_and_the_rest_as_consequences() -> None:
    rep = name_the_cause(AuditReport([_host("h0", 0, "2026-12-04T16:00:02Z", 1),
                                      _host("h2", 2, "2026-12-04T16:00:01Z", 137),
                                      HostResult("h1", "f", "pass")], "fast", "serving", ["serving"]))
    assert rep.first_exit is not None and rep.first_exit["host"] == "h2"
    js = rep.to_json()
    assert js["first_exit"]["rank"] == 2 and [e["host"] for e in js["first_exit"]["consequences"]] == ["h0"]
    assert js["hosts"]["h2"]["message"].startswith(f"{EXIT_CHECK}: rank 2 (h2) exited first (exit code 137 at "
                                                   "2026-12-04T16:00:01Z): the cause; its last log lines: log of 2")
    assert js["hosts"]["h0"]["message"].startswith(f"{EXIT_CHECK}: rank 0 exited after rank 2 (h2)")
    assert js["hosts"]["h1"]["status"] == "pass"
    clean = name_the_cause(AuditReport([HostResult("h1", "f", "pass")], "full", "all", []))
    assert clean.first_exit is None and clean.to_json()["content"] == "sha256"


def test_status_names_the_cause() -> None:
    hosts = [HostStatus("h0", 0, "head", container="exited", exit_code="1", finished_at="2026-12-04T16:00:02Z"),
             HostStatus("h1", 1, "worker", container="running", up=True),
             HostStatus("h2", 2, "worker", container="exited", exit_code="137", finished_at="2026-12-04T16:00:01Z",
                        log="last words")]
    st = FleetStatus("f", "l", "0" * 64, None, hosts=hosts)
    status_cause(st)
    assert st.first_exit is not None and st.first_exit["host"] == "h2"
    assert [h.exited for h in hosts] == ["after rank 2", "", "first"]
    assert "exited first (exit code 137" in hosts[2].message and "last words" in hosts[2].message
    assert "rank 2 (h2) exited first" in st.summary and "1 rank(s) exited after it" in st.summary
