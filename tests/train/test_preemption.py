"""Preemption: a real SIGTERM while a guard handles it only asks to stop; a second one exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import torchfold.train
import torchfold.train.loop.trainer
from torchfold.train.loop.preemption import (
    PREEMPTED_EXIT_CODE,
    Preempted,
    SigtermGuard,
    Terminated,
    terminated_on_sigterm,
)


def test_sigterm_is_recorded_and_the_previous_handler_comes_back(capfd: pytest.CaptureFixture[str]) -> None:
    guard = SigtermGuard(rank=2)
    before = signal.getsignal(signal.SIGTERM)
    with guard.handling(timeout=60.0, step=lambda: 5):
        assert not guard.received
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this (the main) thread before the next line
        assert guard.received
    assert not guard.received  # a later fit() starts afresh
    assert signal.getsignal(signal.SIGTERM) is before
    assert (
        "torchfold: rank 2: SIGTERM received: finishing step 5, then writing a checkpoint"
        in capfd.readouterr().err
    )


def test_off_the_main_thread_nothing_is_installed() -> None:
    guard = SigtermGuard()
    seen: list[object] = []

    def run() -> None:
        with guard.handling(timeout=60.0, step=lambda: 0):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [before]


_TWICE = textwrap.dedent(
    """
    import os, signal, time
    from torchfold.train.loop.preemption import SigtermGuard

    with SigtermGuard(rank=0).handling(timeout=60.0, step=lambda: 4):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # never reached: the second SIGTERM exits at once
    """
)


def test_a_second_sigterm_exits_at_once_with_the_status_of_a_killed_process() -> None:
    proc = subprocess.run([sys.executable, "-c", _TWICE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM == 143, proc.stderr
    assert "torchfold: rank 0: a second SIGTERM; exiting now without a checkpoint" in proc.stderr


def test_preempted_imports_from_where_it_did_and_says_how_to_resume(tmp_path: Path) -> None:
    assert torchfold.train.Preempted is torchfold.train.loop.trainer.Preempted is Preempted
    assert torchfold.train.PREEMPTED_EXIT_CODE == torchfold.train.loop.trainer.PREEMPTED_EXIT_CODE == 75
    error = Preempted(8, tmp_path / "step-00000008.pt")
    assert error.exit_code == PREEMPTED_EXIT_CODE and error.step == 8
    assert str(error) == (
        f"SIGTERM received: stopped after step 7 and wrote checkpoint {tmp_path}/step-00000008.pt; run the same "
        "command again to resume, on any number of processes"
    )


def test_outside_a_step_sigterm_raises_terminated_and_a_forked_child_dies_of_it() -> None:
    # Before the trainer handled it (while `torchfold train` started), SIGTERM killed the run
    # without a word: the command line turns Terminated into one line and exit status 75.
    with pytest.raises(Terminated), terminated_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)  # never reached: Terminated is raised first
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with terminated_on_sigterm():
        child = os.fork()
        if child == 0:  # a loader's worker, forked with the handler
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)  # not reached: it dies of the signal
        _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
