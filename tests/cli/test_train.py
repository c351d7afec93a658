"""`python -m torchfold train`: resume keeps the history, one run per checkpoint directory, one-line errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _train_cli import run_train, small_run, write_sst

from torchfold._validate import max_threads
from torchfold.engine.static.shapes import StaticShapes
from torchfold.train.loop.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from torchfold.train.schedule.trace import BatchSizeTrace

REPO = Path(__file__).resolve().parents[2]


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return small_run(tmp_path, "--workers", "0", *extra)


def _usage_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    [line] = err.splitlines()  # one line, no traceback
    assert line.startswith("torchfold train: error: ") or line.startswith(
        "python -m torchfold train: error: "
    )
    for needle in needles:
        assert needle in line, line


def test_resume_appends_to_the_history_dropping_the_steps_it_repeats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    history, ck = tmp_path / "history.jsonl", tmp_path / "ck"
    common = ("--history", str(history), "--checkpoint-dir", str(ck), "--checkpoint-every", "2")
    assert run_train(_args(tmp_path, "--max-steps", "3", *common), capsys)[0] == 0  # checkpoints at 2 and 3
    (ck / "step-00000003.pt").unlink()  # resume from step 2: step 2's line is repeated
    code, out, err = run_train(_args(tmp_path, "--max-steps", "5", *common), capsys)
    assert code == 0 and "resumed from" in out and "at step 2" in out, err
    steps = [json.loads(line)["step"] for line in history.read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]
    code, out, err = run_train(_args(tmp_path, "--max-steps", "5", *common, "--no-resume"), capsys)
    assert code == 0 and "resumed" not in out
    assert [json.loads(line)["step"] for line in history.read_text().splitlines()] == [0, 1, 2, 3, 4]


def test_a_run_killed_right_after_a_checkpoint_keeps_every_history_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The checkpoint of step K was written before the history line of step K-1: a run killed
    # between the two resumed at K, and the line of step K-1 was gone.
    history, ck = tmp_path / "history.jsonl", tmp_path / "ck"
    args = _args(tmp_path, "--max-steps", "5", "--history", str(history), "--checkpoint-dir", str(ck))
    args += ["--checkpoint-every", "1"]
    killed_after_checkpoint_3 = (
        "import os, signal, sys\n"
        "import torchfold.train.loop.trainer_state as trainer_state\n"
        "from torchfold.cli.train import main\n"
        "save = trainer_state.save_checkpoint\n"
        "def save_then_die(state, path):\n"
        "    save(state, path)\n"
        "    if state['step'] == 3:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "trainer_state.save_checkpoint = save_then_die\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(
        [sys.executable, "-c", killed_after_checkpoint_3, *args],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert latest_checkpoint(ck) == ck / "step-00000003.pt"
    assert [json.loads(line)["step"] for line in history.read_text().splitlines()] == [0, 1, 2]
    code, out, err = run_train(args, capsys)
    assert code == 0 and "at step 3" in out, err
    assert [json.loads(line)["step"] for line in history.read_text().splitlines()] == [0, 1, 2, 3, 4]


# Run first by `python -m torchfold train` (sitecustomize): when torch's import starts, say so on
# fd READY_FD and wait there for the test's signal.
_PAUSE_IN_TORCH_IMPORT = """
import os, sys, time

class PauseInTorchImport:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.write(int(os.environ["READY_FD"]), b"importing torch")
            time.sleep(300)
        return None

sys.meta_path.insert(0, PauseInTorchImport())
"""


def test_sigterm_while_torch_is_imported_exits_75_with_a_line(tmp_path: Path) -> None:
    # In the first second (importing torch), SIGTERM killed the run silently with status 143.
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_PAUSE_IN_TORCH_IMPORT)
    path = os.pathsep.join([str(hooks), str(REPO), os.environ.get("PYTHONPATH", "")])
    read, write = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "torchfold", "train", *_args(tmp_path, "--max-steps", "2")],
            env={**os.environ, "PYTHONPATH": path, "READY_FD": str(write)},
            pass_fds=(write,),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.close(write)
        assert os.read(read, 100) == b"importing torch", child.communicate()
    finally:
        os.close(read)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 75, (child.returncode, err)
    assert err.splitlines() == [
        "torchfold train: SIGTERM received before training started: stopped (nothing was written); run the "
        "same command again to start, or to resume from the newest checkpoint"
    ]
    assert out == ""


def test_sigterm_after_start_up_before_training_exits_75_with_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past the imports, before the trainer handles SIGTERM (here: while the trace is read).
    parse = BatchSizeTrace.parse

    def parse_then_sigterm(source: Any) -> BatchSizeTrace:
        os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: here, in main()
        return parse(source)

    monkeypatch.setattr(BatchSizeTrace, "parse", staticmethod(parse_then_sigterm))
    ck = tmp_path / "ck"
    code, _out, err = run_train(_args(tmp_path, "--max-steps", "2", "--checkpoint-dir", str(ck)), capsys)
    assert code == 75, err
    assert err.splitlines() == [
        "torchfold train: SIGTERM received outside a training step: stopped; the checkpoints written before it "
        "are kept: run the same command again to resume from the newest"
    ]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the test process's handler is back
    monkeypatch.undo()
    assert run_train(_args(tmp_path, "--max-steps", "2", "--checkpoint-dir", str(ck)), capsys)[0] == 0


def _child(tmp_path: Path, ck: Path, max_steps: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    args = _args(tmp_path, "--max-steps", max_steps, "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    return subprocess.Popen(
        [sys.executable, "-m", "torchfold", "train", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_second_run_on_a_checkpoint_directory_in_use_is_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    first = _child(tmp_path, ck, "100000")  # long enough to be running when the second starts
    try:
        deadline = time.monotonic() + 120
        while not list(ck.glob("step-*.pt")):  # it holds the lock before its first checkpoint
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run wrote no checkpoint"
            time.sleep(0.1)
        second = _child(tmp_path, ck, "3")
        _out, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        [line] = err.splitlines()
        assert str(ck) in line and f"pid {first.pid} on host {socket.gethostname()}" in line, line
        assert first.poll() is None  # the first run goes on
    finally:
        first.terminate()  # SIGTERM: it stops after the step, with a checkpoint
        first.communicate(timeout=120)
    assert first.returncode == 75
    after = _child(tmp_path, ck, "0")  # the lock went with the process
    _out, err = after.communicate(timeout=120)
    assert after.returncode == 0, err


def test_too_many_threads_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run_train(_args(tmp_path, "--max-steps", "1", "--threads", "100000"), capsys)
    assert code == 2 and "argument --threads: must be at most" in err and "got 100000" in err, err
    code, _out, err = run_train(_args(tmp_path, "--max-steps", "1", "--threads", str(max_threads())), capsys)
    assert code == 0, err


def test_packing_levels_without_static_shapes_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # On the CPU without --compile folds run unpadded: there is no envelope to pack.
    code, _out, err = run_train(
        _args(tmp_path, "--max-steps", "1", "--device", "cpu", "--pack-levels"), capsys
    )
    _usage_error(code, err, "--pack-levels", "on cpu with --compile auto", "add --compile on")


def test_packing_levels_reaches_the_static_shapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # --compile on pads folds into static shapes on the CPU too; stop once the envelope is made
    # (the compiled steps themselves are the XLA lane's and tests/train/capture/test_compiled.py's)
    import torchfold.cli.train as cli

    made: list[StaticShapes] = []

    def static_shapes(*args: Any, **kwargs: Any) -> StaticShapes:
        made.append(cli_static_shapes(*args, **kwargs))
        raise ValueError("the envelope is made")

    cli_static_shapes = cli.fit_static_shapes
    monkeypatch.setattr(cli, "fit_static_shapes", static_shapes)
    for extra, packed in ((["--pack-levels"], True), ([], False)):
        code, _out, err = run_train(
            _args(tmp_path, "--max-steps", "1", "--device", "cpu", "--compile", "on", *extra), capsys
        )
        assert code == 2 and "the envelope is made" in err, err
        assert made[-1].pack_levels is packed


def test_paths_of_the_wrong_kind_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = run_train(
        ["--trace", str(folder), "--data", str(write_sst(tmp_path, 24)), "--max-steps", "1"], capsys
    )
    _usage_error(code, err, f"--trace {folder} is a directory")
    code, _, err = run_train(_args(tmp_path, "--max-steps", "1", "--history", str(folder)), capsys)
    _usage_error(code, err, f"--history {folder} is a directory")
    code, _, err = run_train(_args(tmp_path, "--max-steps", "1", "--checkpoint-dir", str(a_file)), capsys)
    _usage_error(code, err, f"--checkpoint-dir {a_file} is a file")


def test_history_makes_its_missing_folder_and_refuses_one_that_is_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--history runs/h.jsonl`` once refused a missing ``runs/`` (``--checkpoint-dir`` makes its folder)."""
    history = tmp_path / "runs" / "a" / "h.jsonl"
    code, _out, err = run_train(_args(tmp_path, "--max-steps", "2", "--history", str(history)), capsys)
    assert code == 0, err
    assert [json.loads(line)["step"] for line in history.read_text().splitlines()] == [0, 1]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _out, err = run_train(
        _args(tmp_path, "--max-steps", "1", "--history", str(a_file / "h.jsonl")), capsys
    )
    _usage_error(code, err, f"--history {a_file / 'h.jsonl'}: {a_file} is a file, not a directory")


def test_an_unwritable_history_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run_train(_args(tmp_path, "--max-steps", "2", "--history", "/dev/full"), capsys)
    assert code == 1, err
    [line] = err.splitlines()
    assert "--history /dev/full" in line and "No space left on device" in line, line


@pytest.fixture
def full_dir(tmp_path: Path) -> object:
    """A directory on a real 64 KiB filesystem (tmpfs; needs root to mount)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.fail("mounting a tiny tmpfs needs root; run this test as root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_checkpoint_that_cannot_be_written_names_the_file_the_cause_and_the_intact_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], full_dir: Path
) -> None:
    # Checkpoints of a few KiB: the first ones fit, a later one fills the filesystem.
    args: list[str] = []
    code, _out, err = run_train(
        _args(
            tmp_path,
            "--max-steps",
            "40",
            "--checkpoint-dir",
            str(full_dir),
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "40",
            *args,
        ),
        capsys,
    )
    assert code == 1, err
    [line] = err.splitlines()
    assert "cannot write checkpoint" in line and "No space left on device" in line, line
    assert "the earlier checkpoints are intact (newest: " in line and "inline_container" not in line, line
    assert not [p for p in full_dir.iterdir() if ".tmp-" in p.name]  # the partial file is gone


@pytest.mark.parametrize(
    ("trace", "needles"),
    [
        ("0", ["--trace 0", "positive integer"]),
        ("-5", ["--trace -5", "positive integer"]),
        ("32.5", ["--trace 32.5", "whole number"]),
        ("no-such-trace.csv", ["--trace no-such-trace.csv: "]),
        ("linear:32", ["--trace linear:32: "]),
    ],
)
def test_trace_mistakes_name_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trace: str, needles: list[str]
) -> None:
    args = ["--trace", trace, "--data", str(write_sst(tmp_path, 24)), "--max-steps", "1"]
    code, _, err = run_train(args, capsys)
    _usage_error(code, err, *needles)
    assert "batch_size" not in err


def test_a_trace_given_as_a_list_trains_its_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--trace 6,12,6`` once said ``No such file or directory``: the command line takes every form
    of trace that ``StepLoader(trace=...)`` does, by one rule (``as_trace``)."""
    history = tmp_path / "history.jsonl"
    args = _args(tmp_path, "--history", str(history))
    args[args.index("--trace") + 1] = "6,12,6"
    code, _out, err = run_train(args, capsys)
    assert code == 0, err
    assert [json.loads(line)["batch_size"] for line in history.read_text().splitlines()] == [6, 12, 6]


def test_an_endless_trace_asks_for_the_cli_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_train(
        ["--trace", "12", "--data", str(write_sst(tmp_path, 24)), "--minibatch-size", "6"], capsys
    )
    _usage_error(code, err, "--trace 12", "--max-steps N or --epochs N")
    assert "fit()" not in err and "max_steps=" not in err


def test_no_data_is_a_usage_error_saying_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHFOLD_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_train(["--trace", "12", "--max-steps", "1", "--minibatch-size", "6"], capsys)
    _usage_error(code, err, "--data DIR", "TORCHFOLD_DATA", "--generate N")


def test_a_missing_data_folder_is_a_usage_error_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    code, _, err = run_train(["--trace", "12", "--data", str(missing), "--max-steps", "1"], capsys)
    _usage_error(
        code, err, f"{missing / 'train.txt'} does not exist; pass --data DIR where DIR holds train.txt"
    )
    assert "root=" not in err


def test_no_resume_sets_the_earlier_checkpoints_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A fresh run into a directory holding a later step's checkpoint lost its own to the pruning
    # (the highest steps were kept: the old run's), and a plain resume continued the old run.
    ck = tmp_path / "ck"
    common = ("--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    assert run_train(_args(tmp_path, "--max-steps", "6", *common), capsys)[0] == 0
    code, out, err = run_train(
        _args(tmp_path, "--max-steps", "3", *common, "--no-resume", "--keep-checkpoints", "1"), capsys
    )
    assert code == 0, err
    assert f"moved the 2 earlier checkpoint(s) in {ck} to {ck / 'earlier-1'} (resume=False" in out
    assert [p.name for _, p in list_checkpoints(ck)] == ["step-00000003.pt"]  # the fresh run's
    assert [p.name for _, p in list_checkpoints(ck / "earlier-1")] == ["step-00000005.pt", "step-00000006.pt"]
    code, out, err = run_train(_args(tmp_path, "--max-steps", "4", *common), capsys)
    assert code == 0 and f"resumed from {ck / 'step-00000003.pt'} at step 3" in out, err


def test_the_accumulation_refusal_names_the_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _out, err = run_train(
        [
            *("--trace", "12", "--data", str(write_sst(tmp_path, 24)), "--max-steps", "1", "--workers", "0"),
            *("--max-device-batch-size", "2", "--max-accumulation", "1"),
        ],
        capsys,
    )
    _usage_error(
        code,
        err,
        "more than --max-accumulation 1 (they hold 2)",
        "raise --max-device-batch-size or --max-accumulation",
    )
    assert "max_accumulation_steps" not in err


def test_a_nan_lr_in_a_checkpoint_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    assert run_train(_args(tmp_path, "--max-steps", "1", "--checkpoint-dir", str(ck)), capsys)[0] == 0
    path = ck / "step-00000001.pt"
    state = load_checkpoint(path)
    state["optimizer"]["param_groups"][0]["lr"] = float("nan")
    save_checkpoint(state, path)
    code, _out, err = run_train(_args(tmp_path, "--max-steps", "2", "--checkpoint-dir", str(ck)), capsys)
    _usage_error(code, err, f"checkpoint {path}", "the lr of its optimizer's param group 0", "got nan")
    assert "--lr nan" not in err


@pytest.mark.parametrize(
    ("changed", "needles"),
    [
        (
            ["--lr-rule", "sqrt", "--ref-batch-size", "8"],
            ["--lr-rule 'linear'", "this run has --lr-rule 'sqrt'"],
        ),
        (["--lr-rule", "linear"], ["--ref-batch-size 8", "this run has --ref-batch-size 12"]),  # the trace's
        (
            ["--lr-rule", "linear", "--ref-batch-size", "8", "--drop-last"],
            ["--drop-last False", "this run has --drop-last True"],
        ),
    ],
)
def test_resuming_with_another_lr_rule_ref_batch_or_drop_last_names_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changed: list[str], needles: list[str]
) -> None:
    ck = ("--checkpoint-dir", str(tmp_path / "ck"))
    first = _args(tmp_path, "--max-steps", "1", *ck, "--lr-rule", "linear", "--ref-batch-size", "8")
    assert run_train(first, capsys)[0] == 0
    code, _out, err = run_train(_args(tmp_path, "--max-steps", "2", *ck, *changed), capsys)
    _usage_error(code, err, *needles, "resume with --")
    for word in ("lr_rule=", "ref_batch_size=", "drop_last=", "sampler"):  # the library's words
        assert word not in err, err


def _with_trace(args: list[str], trace: str) -> list[str]:
    args = list(args)
    args[args.index("--trace") + 1] = trace
    return args


def test_resuming_with_a_longer_trace_trains_on_as_one_run_on_it_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace whose first steps are the checkpoint's, and more, once was refused by a fingerprint of
    the whole trace: training longer was impossible."""
    ck, whole = tmp_path / "ck", tmp_path / "whole"
    code, _out, err = run_train(_with_trace(_args(tmp_path, "--checkpoint-dir", str(ck)), "12,12"), capsys)
    assert code == 0, err  # one epoch of the 24 trees
    code, out, err = run_train(
        _with_trace(_args(tmp_path, "--checkpoint-dir", str(ck)), "12,12,12,18"), capsys
    )
    assert code == 0 and "at step 2" in out and "done: 2 steps" in out and "up to step 4" in out, out + err
    assert (
        run_train(_with_trace(_args(tmp_path, "--checkpoint-dir", str(whole)), "12,12,12,18"), capsys)[0] == 0
    )
    resumed, straight = (load_checkpoint(d / "step-00000004.pt")["model"] for d in (ck, whole))
    assert resumed.keys() == straight.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-6, msg=name)


def test_resuming_with_another_trace_names_the_step_and_both_batch_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = ("--checkpoint-dir", str(tmp_path / "ck"))
    assert run_train(_with_trace(_args(tmp_path, *ck), "12,12"), capsys)[0] == 0
    code, _out, err = run_train(_with_trace(_args(tmp_path, *ck), "12,6,6"), capsys)
    _usage_error(
        code,
        err,
        "step-00000002.pt has taken 2 steps of another trace",
        "its step 1 had batch size 12, and --trace 12,6,6 has 6 there",
        "resume with a --trace whose first 2 steps are the checkpoint's (it may go on longer)",
        "--no-resume",
    )
    assert "fingerprint" not in err and "sampler" not in err, err


def test_the_log_lines_and_the_done_line_say_what_their_loss_is_a_mean_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args(tmp_path, "--max-steps", "3")
    args[args.index("--log-every") + 1] = "2"  # small_run's is 0
    code, out, err = run_train(args, capsys)
    assert code == 0, err
    two, one, done = (line for line in out.splitlines() if line.startswith(("step ", "done:")))
    assert two.startswith("step 2/3 | ") and " (mean over the last 2 steps) | " in two, two
    assert one.startswith("step 3/3 | ") and " (mean over the last step) | " in one, one
    # the last line's one step is the step the done line gives
    last = one.split("| loss ")[1].split(" ")[0]
    assert done.endswith(f"up to step 3; loss {last} (mean over the last step)"), done


def test_a_label_outside_0_to_4_is_refused_naming_the_file_line_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "bad"
    data.mkdir()
    (data / "train.txt").write_text("(3 (2 a) (3 good))\n(3 (2 a) (7 good))\n")
    code, _out, err = run_train(
        ["--trace", "2", "--data", str(data), "--max-steps", "1", "--workers", "0"], capsys
    )
    assert code == 2, err
    assert err.startswith(
        f"torchfold train: error: {data / 'train.txt'}:2:11: expected a label from 0 to 4"
    ), err
    assert "got 7" in err and "Traceback" not in err and "IndexError" not in err


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_exit_status_130(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = _args(tmp_path, "--max-steps", "100000", "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    child = subprocess.Popen(
        [sys.executable, "-m", "torchfold", "train", *args, "--workers", "1"],
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # a background job (CI) ignores SIGINT, and Python then installs no handler for it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not list(ck.glob("step-*.pt")):  # training, with its worker, once a checkpoint exists
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the run wrote no checkpoint"
            time.sleep(0.1)
        os.killpg(child.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        _out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 130, err
    assert err.splitlines() == [
        "torchfold train: interrupted (Ctrl-C); the checkpoints written before it are kept: run the same command "
        "again to resume from the newest"
    ]
    assert load_checkpoint(latest_checkpoint(ck) or ck)["step"] >= 1


def test_a_torch_xla_that_fails_to_import_is_named_with_both_versions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A torch_xla built for another torch is installed but its import fails (an undefined symbol):
    # the error says so, with both versions, instead of "not installed".
    site = tmp_path / "site"
    (site / "torch_xla").mkdir(parents=True)
    (site / "torch_xla" / "__init__.py").write_text(
        "raise ImportError('_XLAC.so: undefined symbol: _ZN5torch8autograd10deleteNodeEPNS0_4NodeE')\n"
    )
    (site / "torch_xla-2.9.0.dist-info").mkdir()
    (site / "torch_xla-2.9.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch_xla\nVersion: 2.9.0\n"
    )
    monkeypatch.syspath_prepend(str(site))
    code, _, err = run_train([*_args(tmp_path), "--max-steps", "1", "--device", "xla"], capsys)
    _usage_error(code, err, "torch_xla 2.9.0 is installed but fails to import", f"torch {torch.__version__}")
    assert "undefined symbol" in err and "pip install 'pytorch-fold[xla]'" in err
    assert "needs torch_xla" not in err


def test_without_minibatch_size_train_picks_one_that_divides_every_batch_of_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHFOLD_DATA")  # --generate, not the test data
    # batches of a converted availability trace: multiples of 2 trees x 8 cores, which 25 divides not
    trace = tmp_path / "tpu.csv"
    trace.write_text("step,batchsize\n0,48\n1,32\n2,80\n")
    args = ["--trace", str(trace), "--generate", "80", "--max-steps", "1", "--workers", "0"]
    code, out, err = run_train([*args, "--hidden-dim", "4", "--embedding-dim", "4", "--no-progress"], capsys)
    assert code == 0, err
    assert "minibatch 16," in out and "done: 1 steps (48 samples" in out
    # a size given on the command line is still checked, never replaced
    code, _, err = run_train([*args, "--minibatch-size", "25"], capsys)
    _usage_error(code, err, "batch size 48 is not a multiple of --minibatch-size 25")


def test_the_banner_says_why_the_run_stops_before_the_last_step_of_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHFOLD_DATA")  # --generate, not the test data
    trace = tmp_path / "t.csv"
    trace.write_text("step,batchsize\n" + "".join(f"{step},8\n" for step in range(5)))
    args = ["--trace", str(trace), "--generate", "12", "--workers", "0"]
    args += ["--hidden-dim", "4", "--embedding-dim", "4"]
    code, out, err = run_train([*args, "--no-progress"], capsys)
    assert code == 0, err
    assert "12 GENERATED trees" in out and "(5 steps)" in out
    assert (
        "run: stops before step 4 of the trace's 5: they hold 2 complete epoch(s) of 12 samples, and the last "
        "1 step(s) would start one the trace cannot finish (--epochs 3 trains them too)"
    ) in out
    assert "done: 4 steps" in out
    code, out, err = run_train([*args, "--no-progress", "--epochs", "3"], capsys)
    assert code == 0 and "run: " not in out and "done: 5 steps" in out, out + err
    code, out, err = run_train([*args, "--no-progress", "--max-steps", "2"], capsys)
    assert code == 0 and "run: stops before step 2 of the trace's 5 (--max-steps 2)" in out, out + err


def test_default_minibatch_size_is_a_deprecated_alias_of_largest_minibatch_size() -> None:
    from torchfold.cli.train import default_minibatch_size
    from torchfold.train.schedule.trace import BatchSizeTrace

    with pytest.warns(FutureWarning, match=r"BatchSizeTrace\.largest_minibatch_size"):
        assert default_minibatch_size(BatchSizeTrace([176, 224, 240])) == 16
