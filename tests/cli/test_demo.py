"""Tests for the main job, ``python -m torchfold demo``, on generated and on real SST trees."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import DATA_DIR
from torchfold.cli.demo import main

ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = DATA_DIR
needs_sst = pytest.mark.usefixtures("data_dir")  # fails (never skips) without the data
TINY = ["--epochs", "1", "--max-train", "50", "--max-dev", "20", "--no-progress", "--threads", "1"]
TINY += ["--embedding-dim", "16", "--hidden-dim", "16"]


def _accuracies(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"dev root accuracy ([0-9.]+) fine-grained", out)]


def test_demo_defaults_to_generated_trees_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TORCHFOLD_DATA", raising=False)
    frozen, threads = gc.get_freeze_count(), torch.get_num_threads()
    assert main(TINY) == 0
    assert (gc.get_freeze_count(), torch.get_num_threads()) == (frozen, threads)  # process state restored
    out = capsys.readouterr().out
    assert "data: GENERATED trees (torchfold.examples.datasets.generate_sst, seed 0)" in out
    assert "50 training trees" in out and "20 dev trees" in out
    assert re.search(r"epoch 1: loss [0-9.]+, [0-9]+ sentences/s \([0-9.]+ s\), dev root accuracy", out)
    assert re.search(r"[0-9.]+ binary \([0-9]+ non-neutral\), all-node accuracy [0-9.]+", out)
    assert len(_accuracies(out)) == 2  # untrained, then after epoch 1


@needs_sst
def test_demo_trains_on_real_sst_from_data_dir(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--data", str(SHARED_DATA / "sst"), "--no-gc-freeze"]) == 0
    out = capsys.readouterr().out
    assert f"data: SST-format trees from --data {SHARED_DATA / 'sst'}" in out
    assert "50 training trees" in out and "epoch 1: loss" in out


@needs_sst
def test_demo_reads_the_env_var(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCHFOLD_DATA", str(SHARED_DATA))
    assert main([*TINY, "--max-train", "10"]) == 0
    assert f"SST-format trees from $TORCHFOLD_DATA={SHARED_DATA}" in capsys.readouterr().out


def test_demo_learns_the_generated_rule(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TORCHFOLD_DATA", raising=False)
    args = ["--epochs", "3", "--generate", "800", "--max-dev", "100", "--no-progress", "--threads", "1"]
    assert main([*args, "--embedding-dim", "32", "--hidden-dim", "32", "--lr", "0.02"]) == 0
    untrained, *_, trained = _accuracies(capsys.readouterr().out)
    assert trained > max(0.5, untrained + 0.25), (untrained, trained)


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (
            ["--data", "/nonexistent/sst"],
            2,
            "SST split 'train' not found: /nonexistent/sst/train.txt does not exist; pass --data DIR where DIR",
        ),
        (["--epochs", "0"], 2, "argument --epochs: must be a positive integer, got 0"),
        (["--lr", "-1"], 2, "argument --lr: must be a positive number"),
        (["--bogus"], 2, "unrecognized arguments: --bogus"),
        (["--device", "nonsense"], 2, "--device 'nonsense': Expected one of"),
    ],
)
def test_demo_reports_bad_input(
    argv: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert message in err and "root=" not in err


def test_demo_reports_a_malformed_data_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.txt").write_text("(2 (2 a) (3 b))\n(2 (2 a) (3 b)\n", encoding="utf-8")
    (tmp_path / "dev.txt").write_text("(2 (2 a) (3 b))\n", encoding="utf-8")
    assert main(["--data", str(tmp_path)]) == 2
    assert f"{tmp_path / 'train.txt'}:2:15: unexpected end of line" in capsys.readouterr().err


def test_python_dash_m_torchfold_demo_runs_end_to_end(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHFOLD_DATA"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "torchfold", "demo", *TINY, "--max-train", "20"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "data: GENERATED trees" in result.stdout and "epoch 1: loss" in result.stdout


def test_redirected_output_gets_epoch_lines_and_no_progress_frames(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TORCHFOLD_DATA", raising=False)
    assert main([arg for arg in TINY if arg != "--no-progress"]) == 0  # stderr is captured: no terminal
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "epoch 1:" not in err, err
    assert re.search(r"^epoch 1: loss [0-9.]+, ", out, flags=re.M)
