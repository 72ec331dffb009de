"""Every user mistake ends in one clear line through the installed `dspark` script (issue 15).

Each test names a class of mistake, checks the exit code, that no traceback shows, that the line
names the culprit, and that the corrected command then succeeds without --force.
"""

from __future__ import annotations

import json

from fixtures.cli import assert_user_error, run_dspark


def _prompts_jsonl(path, n: int = 4):
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q {i}"}]})
                            + "\n" for i in range(n)))
    return path


def test_usage_errors_are_clicks_one_line_and_exit_2(tmp_path):
    """Bad value, unknown flag, flag without value, unknown command: click's message, exit 2."""
    src = str(_prompts_jsonl(tmp_path / "a.jsonl"))
    for args, culprit in [
        (["data", "prepare", "--source", src, "--val-fraction", "abc"], "--val-fraction"),
        (["data", "prepare", "--sourc", src], "--sourc"),
        (["data", "prepare", "--source"], "--source"),
        (["datum", "prepare"], "datum"),
    ]:
        proc = run_dspark(*args, cwd=tmp_path)
        assert_user_error(proc, culprit)
        assert "Usage:" in proc.stderr or "requires an argument" in proc.stderr, proc.stderr
    fixed = run_dspark("data", "prepare", "--source", src, "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
