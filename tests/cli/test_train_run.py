"""``train``'s run-side helpers (``torchfold/cli/train_run.py``): the ``--history`` file on resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchfold.cli.train_run import StepHistory


def _lines(steps: range) -> str:
    return "".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in steps)


def test_a_resumed_history_keeps_the_steps_before_the_resume_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    path.write_text(_lines(range(6)) + '{"step": 6, "lo')  # a line cut short by a crash
    history = StepHistory(str(path))
    history.open(resumed_at=4)
    history.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.jsonl"]  # no spare file left


def test_a_failed_rewrite_leaves_the_old_history_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kept lines replace the file in one step: a failure (or a kill) before it leaves every old line."""
    path = tmp_path / "history.jsonl"
    path.write_text(_lines(range(6)))

    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(
        OSError, match=r"--history .*history.jsonl: cannot write it \(No space left on device\)"
    ):
        StepHistory(str(path)).open(resumed_at=3)
    assert path.read_text() == _lines(range(6))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.jsonl"]


def test_a_resumed_history_keeps_its_permissions_and_its_symlink(tmp_path: Path) -> None:
    target = tmp_path / "runs" / "history.jsonl"
    target.parent.mkdir()
    target.write_text(_lines(range(4)))
    target.chmod(0o640)
    link = tmp_path / "history.jsonl"
    link.symlink_to(target)
    history = StepHistory(str(link))
    history.open(resumed_at=2)
    history.close()
    assert link.is_symlink() and link.resolve() == target
    assert [json.loads(line)["step"] for line in target.read_text().splitlines()] == [0, 1]
    assert target.stat().st_mode & 0o777 == 0o640
