"""Elastic training: resume on another number of processes, a per-device maximum, SIGTERM, torchrun's agent.

Multi-process tests run real processes (gloo on localhost) on real SST trees with a float64
Tree-LSTM; the signals are real signals sent to real processes. The reference is always one
uninterrupted process on the same trace: the elastic runs must end with its parameters, up to the
float64 summation order (``torch.testing.assert_close``'s default tolerance for float64).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _dist_worker import free_port, run_ranks
from _loop_worker import TRACE, make_trainer, params_of, sst_trees, train_rank
from _train_cli import train, write_sst

from torchfold.train.loop.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from torchfold.train.loop.trainer import PREEMPTED_EXIT_CODE

REPO = Path(__file__).resolve().parents[2]
MAX_DEVICE = 7  # per-device maximum in the elastic-split tests: uneven splits, never a multiple


def _ok(results: list[dict | None]) -> list[dict]:
    for rank, result in enumerate(results):
        assert result is not None and "ok" in result, f"rank {rank}: {result}"
    return [result["ok"] for result in results]  # type: ignore[index]


# -- the split follows the devices present -------------------------------------------------------


def test_a_per_device_maximum_sets_the_minibatches_of_every_step() -> None:
    trainer = make_trainer(sst_trees(), max_device_batch_size=MAX_DEVICE)
    history = trainer.fit()
    assert [s.num_minibatches for s in history] == [-(-s.batch_size // MAX_DEVICE) for s in history]
    assert trainer.minibatch_size is None  # uneven minibatches: weighted one by one


@pytest.mark.slow
def test_a_per_device_maximum_on_three_processes_equals_one_process(tmp_path: Path) -> None:
    expected = make_trainer(sst_trees(), max_device_batch_size=MAX_DEVICE, seed=100)  # rank 0's init
    expected_history = expected.fit()
    run = {"name": "elastic", "max_device_batch_size": MAX_DEVICE}
    results = _ok(run_ranks(train_rank, [(3, free_port(), [run])] * 3, tmp_path, timeout=120))
    for rank, result in enumerate(results):
        history = result["elastic"]["history"]
        # 3 devices: ceil(batch / (3 * 7)) minibatches each (some ranks none), never above 7 trees
        assert [max(1, -(-s.batch_size // (3 * MAX_DEVICE))) for s in history] == [
            -(-s.num_minibatches // 3) for s in history
        ]
        assert [s.loss for s in history] == pytest.approx([s.loss for s in expected_history], rel=1e-9)
        torch.testing.assert_close(result["elastic"]["params"], params_of(expected.model), msg=f"rank {rank}")


# -- resume on another world size ----------------------------------------------------------------


@pytest.mark.slow
def test_two_then_three_then_one_processes_with_kills_equal_one_uninterrupted_process(tmp_path: Path) -> None:
    """2 processes -> SIGKILL -> 3 -> SIGKILL -> 1: the parameters of one uninterrupted process.

    With dropout and Python-random jitter in every minibatch, AdaScale (whose averages depend on
    each minibatch's gradient) and per-minibatch seeding: equal only if the steps, their
    minibatches, their random draws and the rule's state all survive the changes of world size.
    """
    ckpt = tmp_path / "ckpt"
    base = {"dropout": True, "minibatch_seed": 11, "lr_rule": "adascale", "checkpoint_dir": str(ckpt)}
    base["checkpoint_every"] = 1
    reference = make_trainer(sst_trees(), dropout=True, minibatch_seed=11, lr_rule="adascale", seed=100)
    reference_history = reference.fit()

    phases = [(2, (1, 4)), (3, (2, 9)), (1, None)]  # (processes, (rank that dies, after step))
    resumed_at = []
    for phase, (world, dies) in enumerate(phases):
        run = {**base, "name": "phase", "resume": phase > 0}
        if dies is not None:
            run["die_after"] = dies
        (tmp_path / f"p{phase}").mkdir()
        results = run_ranks(
            train_rank, [(world, free_port(), [run])] * world, tmp_path / f"p{phase}", timeout=120
        )
        if dies is not None:
            assert results[dies[0]] is None  # SIGKILLed
            survivors = [r for rank, r in enumerate(results) if rank != dies[0]]
            assert all(r is not None and "error" in r["ok"]["phase"] for r in survivors), survivors
            assert list_checkpoints(ckpt)[-1][0] == dies[1] + 1
            assert load_checkpoint(list_checkpoints(ckpt)[-1][1])["world_size"] == world
        else:
            [out] = _ok(results)
            resumed_at.append(out["phase"]["resumed"])
            history = out["phase"]["history"]
            assert [s.step for s in history] == list(range(10, len(TRACE) - 1))
            assert {s.num_replicas for s in history} == {1}
            assert [s.loss for s in history] == pytest.approx(
                [s.loss for s in reference_history[10:]], rel=1e-9
            )
            torch.testing.assert_close(out["phase"]["params"], params_of(reference.model))
    assert resumed_at == ["step-00000010.pt"]


def _one_process_checkpoint(tmp_path: Path, steps: int) -> Path:
    trainer = make_trainer(sst_trees(), dropout=True, checkpoint_dir=str(tmp_path))
    trainer.fit(max_steps=steps)
    return tmp_path / f"step-{steps:08d}.pt"


def test_without_a_minibatch_seed_another_world_size_warns_that_draws_differ(tmp_path: Path) -> None:
    path = _one_process_checkpoint(tmp_path, 3)
    state = load_checkpoint(path)
    state.update(world_size=2, rng=state["rng"] * 2)  # as if written by two processes
    save_checkpoint(state, path)
    trainer = make_trainer(sst_trees(), dropout=True)
    with pytest.warns(
        UserWarning, match=r"written by 2 processes and this run has 1: the generators are re-seeded"
    ):
        trainer.load_checkpoint(path)
    assert trainer.next_step == 3


def test_with_a_minibatch_seed_a_resume_is_exact_without_the_generator_states(tmp_path: Path) -> None:
    whole = make_trainer(sst_trees(), dropout=True, minibatch_seed=3)
    whole.fit()
    first = make_trainer(sst_trees(), dropout=True, minibatch_seed=3, checkpoint_dir=str(tmp_path))
    first.fit(max_steps=5)
    state = load_checkpoint(tmp_path / "step-00000005.pt")
    state.update(world_size=3, rng=state["rng"] * 3)
    save_checkpoint(state, tmp_path / "step-00000005.pt")
    torch.manual_seed(12345)  # the process's generators are elsewhere: only the per-minibatch seeds count
    second = make_trainer(sst_trees(), dropout=True, minibatch_seed=3, checkpoint_dir=str(tmp_path))
    second.resume()
    second.fit()
    torch.testing.assert_close(params_of(second.model), params_of(whole.model), rtol=0, atol=0)


def test_the_minibatch_seed_changes_the_draws() -> None:
    a = make_trainer(sst_trees(), dropout=True, minibatch_seed=3)
    b = make_trainer(sst_trees(), dropout=True, minibatch_seed=4)
    assert a.fit(max_steps=2)[-1].loss != b.fit(max_steps=2)[-1].loss


# -- the command line: bad input, SIGTERM -------------------------------------------------------


def _cli(tmp_path: Path, ckpt: Path, *extra: str, repeat: int = 1) -> list[str]:
    trace = tmp_path / "trace.csv"
    trace.write_text("step,batchsize\n" + "".join(f"{i},{b}\n" for i, b in enumerate(TRACE * repeat)))
    return [
        *("--trace", str(trace), "--data", str(write_sst(tmp_path)), "--lr", "0.01"),
        *("--embedding-dim", "8", "--hidden-dim", "12", "--dtype", "float64", "--seed", "100"),
        *("--checkpoint-dir", str(ckpt), "--no-progress", "--timeout", "20", "--workers", "0"),
        *extra,
    ]


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def test_the_cli_refuses_a_checkpoint_of_another_split_naming_the_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    assert train([*_cli(tmp_path, ckpt, "--max-device-batch-size", "8", "--max-steps", "2")]) == 0
    capsys.readouterr()
    assert train([*_cli(tmp_path, ckpt, "--max-device-batch-size", "6", "--max-steps", "3")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"written with --max-device-batch-size 8, this run has --max-device-batch-size 6", err)
    assert train([*_cli(tmp_path, ckpt, "--minibatch-size", "6", "--max-steps", "3")]) == 2
    assert "written with --minibatch-size None, this run has --minibatch-size 6" in capsys.readouterr().err
    assert train([*_cli(tmp_path, ckpt, "--max-device-batch-size", "8", "--hidden-dim", "10")]) == 2
    assert "written with --hidden-dim 12, this run has --hidden-dim 10" in capsys.readouterr().err
    # A global batch the devices cannot hold within the accumulation limit: the step is named
    assert train([*_cli(tmp_path, ckpt, "--max-device-batch-size", "8", "--max-accumulation", "2")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"line 4 \(step 2\): a global batch of 18 needs 3 accumulation steps on 1 device", err)
    assert train([*_cli(tmp_path, ckpt, "--max-device-batch-size", "0")]) == 2
    assert "argument --max-device-batch-size: must be a positive integer, got 0" in capsys.readouterr().err


def _wait_for(path: Path, pattern: str, procs: list[subprocess.Popen[str]], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text()):
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a process ended early: {[p.poll() for p in procs]}")
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} did not appear in {path} within {timeout} s")


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_after_the_step_with_one_checkpoint(tmp_path: Path) -> None:
    """SIGTERM to rank 1 of 2: both finish the step, one checkpoint, exit 75; one process resumes it."""
    ckpt = tmp_path / "ckpt"
    port = free_port()
    log = tmp_path / "history.jsonl"
    args = _cli(tmp_path, ckpt, "--max-device-batch-size", "8", "--history", str(log), repeat=4)
    procs = []
    for rank in range(2):
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = str(port)
        command = [sys.executable, "-m", "torchfold", "train", *args]
        procs.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    try:
        _wait_for(log, r'"step": 2,', procs)
        procs[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [PREEMPTED_EXIT_CODE] * 2, outputs
    assert "SIGTERM received on rank 1" not in outputs[0][1]  # only rank 1 got the signal
    assert "rank 1: SIGTERM received: finishing step" in outputs[1][1]
    [(step, path)] = list_checkpoints(ckpt)  # no --checkpoint-every: only the preemption's
    assert 3 <= step < 40  # 4 epochs of 120 trees hold 55 steps
    message = f"SIGTERM received: stopped after step {step - 1} and wrote checkpoint {path}"
    assert all(message in err for _, err in outputs), outputs
    assert load_checkpoint(path)["world_size"] == 2

    # One process takes over from the checkpoint and ends where one uninterrupted process ends
    assert train(_cli(tmp_path, ckpt, "--max-device-batch-size", "8", repeat=4)) == 0
    assert train(_cli(tmp_path, tmp_path / "whole", "--max-device-batch-size", "8", repeat=4)) == 0
    (end, resumed), (same_end, whole) = list_checkpoints(ckpt)[-1], list_checkpoints(tmp_path / "whole")[-1]
    assert end == same_end > step
    torch.testing.assert_close(load_checkpoint(resumed)["model"], load_checkpoint(whole)["model"])


_SLOW_LOOP = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from _loop_worker import make_trainer, sst_trees
    import torchfold.examples.models as models

    def slow_loss(model, outputs, targets):
        print("step", flush=True)
        time.sleep(3)
        return models.tree_lstm_loss(model, outputs, targets)

    trainer = make_trainer(sst_trees(), checkpoint_dir={ckpt!r})
    trainer.loss = slow_loss
    trainer.preemption_timeout = {timeout}
    trainer.fit()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signals", "timeout", "message"),
    [
        (2, 60.0, "rank 0: a second SIGTERM; exiting now without a checkpoint"),
        (
            1,
            0.5,
            "rank 0: the step and its checkpoint took longer than preemption_timeout=0.5 s; exiting now",
        ),
    ],
)
def test_a_second_sigterm_or_the_timeout_exits_at_once(
    tmp_path: Path, signals: int, timeout: float, message: str
) -> None:
    script = _SLOW_LOOP.format(
        tests=str(REPO / "tests" / "helpers"), ckpt=str(tmp_path / "ckpt"), timeout=timeout
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "step\n"  # inside the first step
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert message in err
    assert time.monotonic() - start < 5  # not after the 3 s step: at once
    assert list_checkpoints(tmp_path / "ckpt") == []
