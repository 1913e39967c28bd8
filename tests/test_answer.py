"""builder.foundation.answer: a real command's answer read one way (its last JSON line, its one-line error)."""

from __future__ import annotations

import subprocess
import sys

from builder.foundation.answer import Answer


def run(code: str) -> Answer:
    return Answer.of(subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60))


def test_the_last_stdout_line_is_the_answer() -> None:
    a = run("print('progress 1'); print('{\"ok\": true, \"n\": 2}')")
    assert a.ok and a.json_object() == {"ok": True, "n": 2}


def test_no_answer_or_not_an_object_is_none() -> None:
    assert run("pass").json_object() is None
    assert run("print('[1, 2]')").json_object() is None
    assert run("print('{not json')").json_object() is None
    assert run("import sys; sys.stdout.buffer.write(b'\\xff\\xfe\\n')").json_object() is None


def test_the_error_line_wins_over_later_lines_then_the_last_line_then_the_exit_status() -> None:
    a = run("import sys; print('error: the disk is full', file=sys.stderr); print('  at line 3', file=sys.stderr);"
            " sys.exit(2)")
    assert (a.rc, a.error()) == (2, "the disk is full")
    assert a.error(()) == "at line 3" and a.last_line() == "at line 3"
    git_like = run("import sys; print('hint: x\\nfatal: not a git repository', file=sys.stderr); sys.exit(128)")
    assert git_like.error(("fatal:", "error:")) == "not a git repository"
    assert run("print('only on stdout'); raise SystemExit(3)").error() == "only on stdout"
    assert run("raise SystemExit(4)").error() == "exit status 4"
