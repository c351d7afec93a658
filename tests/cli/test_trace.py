"""Tests for ``python -m torchfold trace check|convert|plot`` (torchfold.cli.trace)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchfold.cli.trace import main
from torchfold.train.schedule.trace import BatchSizeTrace

REPO = Path(__file__).resolve().parents[2]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_check_example_trace(traces_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = traces_dir / "step_batchsize_example.csv"
    code, out, err = run(
        ["check", str(path), "--minibatch-size", "32", "--dataset-size", "60000", "--epochs", "12"], capsys
    )
    assert (code, err) == (0, "")
    assert "steps:          810" in out
    assert "batch size:     min 32, max 2048, mean 950.0" in out
    assert "total samples:  769472" in out
    assert "segments:       2 (step numbering restarts at 0 at" in out and "line 12 (step 10)" in out
    assert "epochs covered: 12 full epochs of 60000 samples (12.82 dataset passes" in out
    assert "epochs 12: ok, they end after step 768" in out


def test_check_and_plot_take_a_trace_as_train_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``trace check "steps:16x4,32x4"`` once said ``No such file or directory``: a trace is written
    the same way everywhere (``as_trace``), on this command too."""
    code, out, err = run(
        ["check", "steps:16x4,32x4", "--minibatch-size", "16", "--dataset-size", "64", "--epochs", "2"],
        capsys,
    )
    assert (code, err) == (0, ""), err
    assert "trace:          steps:16x4,32x4" in out and "steps:          8" in out
    assert "total samples:  192" in out and "epochs 2: ok, they end after step 5" in out
    code, out, err = run(["check", "16,32,48"], capsys)
    assert (code, err) == (0, "") and "batch size:     min 16, max 48, mean 32.0" in out
    code, out, err = run(["check", "32", "--dataset-size", "100", "--epochs", "3"], capsys)
    assert (code, err) == (0, ""), err
    assert (
        "steps:          unbounded (every step 32)" in out and "epochs 3: ok, they end after step 11" in out
    )
    code, out, err = run(["check", "linear:32"], capsys)
    assert code == 1 and "bad schedule part 'linear:32'" in err and "No such file" not in err
    code, out, err = run(["plot", "constant:32:4+constant:64:4", "-o", str(tmp_path / "t.png")], capsys)
    assert (code, err) == (0, "") and "(8 steps)" in out, err
    code, out, err = run(["plot", "32", "-o", str(tmp_path / "u.png")], capsys)
    assert (
        code == 1 and "32 is a constant batch size without an end; give it one, e.g. constant:32:1000" in err
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--minibatch-size", "48"],
            "line 2 (step 0): batch size 128 is not a multiple of --minibatch-size 48",
        ),
        (["--dataset-size", "60000", "--epochs", "13"], "is too short: it has 810 steps"),
    ],
)
def test_check_rejects(
    traces_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    path = traces_dir / "step_batchsize_example.csv"
    code, out, err = run(["check", str(path), *args], capsys)
    assert code == 1 and out == ""
    assert err.startswith("torchfold trace check: error: ") and message in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("step,batchsize\n0,32\n1,x\n", "line 3: batch size should be an integer, got 'x'"),
        ("step,batchsize\n0,32\n2,32\n", "line 3: missing step 1 before step 2"),
        ("step,batchsize\n0,32\n1,-32\n", "line 3: batch size should be positive, got -32"),
    ],
)
def test_check_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    code, _, err = run(["check", str(path)], capsys)
    assert code == 1 and f"{path}, {message}" in err


def test_check_missing_file_and_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["check", str(tmp_path / "none.csv")], capsys)
    assert code == 2 and "none.csv" in err  # a usage mistake, as the README says
    code, _, err = run(["check", str(tmp_path / "none.csv"), "--epochs", "2"], capsys)
    assert code == 2 and "--epochs needs --dataset-size" in err
    code, _, err = run(["check", "x.csv", "--minibatch-size", "0"], capsys)
    assert code == 2 and "must be a positive integer, got 0" in err
    code, _, err = run(["frobnicate"], capsys)
    assert code == 2 and "invalid choice" in err
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "check" in out and "convert" in out and "plot" in out


def test_convert_availability_trace(
    traces_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_csv = tmp_path / "a100.csv"
    source = traces_dir / "gcp_a100_gpus.csv"
    code, out, err = run(
        ["convert", str(source), "--per-device-batch", "32", "--step-time", "9", "-o", str(out_csv)], capsys
    )
    assert (code, err) == (0, "")
    assert f"written:        {out_csv}" in out
    converted = BatchSizeTrace.from_csv(out_csv)
    assert converted == BatchSizeTrace.from_availability(source, 32, 9.0)
    # 63 s intervals hold 7 steps of 9 s; 0-GPU intervals hold none.
    rows = [line.split(",") for line in source.read_text().splitlines()[1:-1]]
    assert list(converted) == [int(r[2]) * 32 for r in rows for _ in range(7) if int(r[2]) > 0]
    code, _, _ = run(
        [
            "convert",
            str(source),
            "--per-device-batch",
            "32",
            "--step-time",
            "9",
            "--max-steps",
            "5",
            "-o",
            str(out_csv),
        ],
        capsys,
    )
    assert code == 0 and len(BatchSizeTrace.from_csv(out_csv)) == 5


def test_convert_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_csv = tmp_path / "ramp.csv"
    code, out, _ = run(
        [
            "convert",
            "--schedule",
            "linear:32:256:1000+constant:256:24",
            "--multiple-of",
            "32",
            "-o",
            str(out_csv),
        ],
        capsys,
    )
    assert code == 0 and "steps:          1024" in out
    trace = BatchSizeTrace.from_csv(out_csv)
    assert trace[0] == 32 and trace[999] == 256 and trace[1023] == 256
    trace.check_minibatch_size(32)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--schedule", "cosine:1:2"], 1, "bad schedule part 'cosine:1:2'"),
        ([], 2, "convert needs either RESOURCE_CSV or --schedule"),
        (["gpus.csv", "--schedule", "constant:8:8"], 2, "convert needs either RESOURCE_CSV or --schedule"),
        (["gpus.csv"], 2, "needs --per-device-batch and --step-time"),
        (["--schedule", "constant:8:8", "--step-time", "1"], 2, "go with RESOURCE_CSV, not --schedule"),
        (
            ["gpus.csv", "--per-device-batch", "8", "--step-time", "-1"],
            2,
            "must be a positive number, got -1.0",
        ),
    ],
)
def test_convert_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: int, message: str
) -> None:
    got, _, err = run(["convert", *args, "-o", str(tmp_path / "o.csv")], capsys)
    assert got == code and message in err
    assert not (tmp_path / "o.csv").exists()


def test_convert_step_trace_is_rejected(
    traces_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "convert",
        str(traces_dir / "step_batchsize_example.csv"),
        "--per-device-batch",
        "8",
        "--step-time",
        "1",
    ]
    code, _, err = run([*args, "-o", str(tmp_path / "o.csv")], capsys)
    assert code == 1 and "line 1: header should name a 'Time' column" in err


@pytest.mark.parametrize("lr_args", [[], ["--lr", "0.1", "--ref-batch-size", "256", "--lr-rule", "sqrt"]])
def test_plot(
    traces_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], lr_args: list[str]
) -> None:
    png = tmp_path / "trace.png"
    code, out, _ = run(
        ["plot", str(traces_dir / "step_batchsize_example.csv"), "-o", str(png), *lr_args], capsys
    )
    assert code == 0 and "810 steps" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_takes_train_flag_names_and_the_old_ones_as_deprecated_aliases(
    traces_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, object]] = []
    monkeypatch.setattr(BatchSizeTrace, "plot", lambda self, path, **kwargs: seen.append(kwargs))
    common = [
        "plot",
        str(traces_dir / "step_batchsize_example.csv"),
        "-o",
        str(tmp_path / "p.png"),
        "--lr",
        "0.1",
    ]
    code, _, err = run([*common, "--ref-batch-size", "64", "--lr-rule", "sqrt"], capsys)
    assert code == 0 and err == ""
    code, _, err = run([*common, "--ref-batch", "64", "--rule", "sqrt"], capsys)
    assert code == 0
    assert (
        "--ref-batch is deprecated; use --ref-batch-size" in err
        and "--rule is deprecated; use --lr-rule" in err
    )
    assert seen == [{"lr": 0.1, "ref_batch_size": 64, "rule": "sqrt"}] * 2
    assert run(["plot", "--help"], capsys)[1].count("--ref-batch ") == 0  # the old spellings are hidden


def test_plot_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plot", "x.csv", "-o", str(tmp_path / "p.png"), "--lr-rule", "cubic"], capsys)
    assert code == 2 and "invalid choice: 'cubic'" in err
    code, _, err = run(["plot", "x.csv", "-o", str(tmp_path / "p.png"), "--ref-batch-size", "64"], capsys)
    assert code == 2 and "--ref-batch-size needs --lr" in err


def test_module_entry_point(traces_dir: Path) -> None:
    """The real command line: `python -m torchfold trace check` passes the exit status and stderr through."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    bad = subprocess.run(
        [sys.executable, "-m", "torchfold", "trace", "check", str(traces_dir / "gcp_a100_gpus.csv")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 1 and bad.stdout == ""
    assert "looks like a resource-availability trace" in bad.stderr


def test_convert_refuses_absurd_step_counts_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 1e12 s gap: --max-steps bounds the work; without it, or at 1e-300 s a step, one line, exit 1."""
    gap = tmp_path / "gap.csv"
    gap.write_text(",Time,GPUs\n0,0,2\n1,1e12,2\n")
    out_csv = tmp_path / "o.csv"
    base = ["convert", str(gap), "--per-device-batch", "8", "-o", str(out_csv)]
    code, out, err = run([*base, "--step-time", "1", "--max-steps", "10"], capsys)
    assert (code, err) == (0, "") and "steps:          10" in out
    assert BatchSizeTrace.from_csv(out_csv).batch_sizes == (16,) * 10
    out_csv.unlink()
    for step_time, message in [
        ("1", "hold 1e+12 steps, more than the 10000000 a trace may have; pass max_steps (--max-steps)"),
        ("1e-300", "its 1e+12 s at step_time=1e-300 s are too many steps to count; use a larger step time"),
    ]:
        code, out, err = run([*base, "--step-time", step_time], capsys)
        assert (code, out) == (1, "")
        assert err.count("\n") == 1 and err.startswith(f"torchfold trace convert: error: {gap}: "), err
        assert message in err
        assert not out_csv.exists()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"step,batchsize\n0,32\n1,\xff\n", "line 3: byte 0xff at column 3 is not UTF-8 text"),
        (b"step,batchsize\n-1,32\n", "line 2: step should be >= 0 (steps count from 0), got -1"),
        (
            b"step,batchsize\n0," + b"9" * 5000 + b"\n",
            "line 2: batch size '999999999999999999999999'... (5000",
        ),
        (
            b"step,batchsize\n0,1_000\n",
            "line 2: batch size should be a plain integer (ASCII digits 0-9 only)",
        ),
        (b"step,batchsize\n0,+32\n", "line 2: batch size should be a plain integer (ASCII digits 0-9 only)"),
        ("step,batchsize\n0,\u0663\u0662\n".encode(), "line 2: batch size should be a plain integer"),
    ],
)
def test_check_bad_values_one_short_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, message: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_bytes(data)
    code, out, err = run(["check", str(path)], capsys)
    assert (code, out) == (1, "")
    assert err.startswith(f"torchfold trace check: error: {path}, {message}"), err[:300]
    assert err.count("\n") == 1 and len(err) < len(str(path)) + 200


def test_plot_without_matplotlib_prints_one_line_naming_the_extra(traces_dir: Path, tmp_path: Path) -> None:
    # matplotlib made unimportable in a real child process (as when the plot extra is not installed)
    script = (
        "import sys\n"
        "sys.modules['matplotlib'] = None\n"
        "from torchfold.cli import main\n"
        f"sys.exit(main(['trace', 'plot', {str(traces_dir / 'step_batchsize_example.csv')!r}, "
        f"'-o', {str(tmp_path / 'x.png')!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.splitlines()  # the message alone, no traceback
    assert line.startswith("torchfold trace plot: error: plotting a trace needs matplotlib"), line
    assert "pip install 'pytorch-fold[plot]'" in line and not (tmp_path / "x.png").exists()
