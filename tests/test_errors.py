"""builder.errors: a host's name said once in what is reported per host."""

from __future__ import annotations

from builder.errors import named, unnamed


def test_named_says_the_host_once() -> None:
    assert named("spark-1", "stop: exit status 1") == "spark-1: stop: exit status 1"
    assert named("spark-1", "spark-1: stop: exit status 1") == "spark-1: stop: exit status 1"
    assert named("spark-1", "spark-1: stop: no", "staging failed") == "spark-1: staging failed: stop: no"
    assert named("spark-1", "no answer", "unreachable") == "spark-1: unreachable: no answer"
    # another host's name (a prefix of this one's, or this one's without its colon) is not this host's
    assert named("spark-10", "spark-1: stop: no") == "spark-10: spark-1: stop: no"
    assert named("spark-1", "spark-10: stop: no") == "spark-1: spark-10: stop: no"


def test_unnamed_drops_the_hosts_own_name_only() -> None:
    assert unnamed("spark-1", "spark-1: stop: exit status 1") == "stop: exit status 1"
    assert unnamed("spark-1", "stop: exit status 1") == "stop: exit status 1"
    assert unnamed("spark-1", "spark-10: stop: no") == "spark-10: stop: no"
