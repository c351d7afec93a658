"""The intra-op thread rule: the user's choice is kept, else one thread, said once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from torchfold.train.loop import threads
from torchfold.train.loop.threads import DEFAULT_THREADS, set_intra_op_threads


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_without_a_choice_the_process_gets_the_default_and_is_told_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in threads.THREAD_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_said", None)
    torch.set_num_threads(3)
    monkeypatch.setattr(threads, "_AT_IMPORT", 3)  # as if torch had started with 3
    line = set_intra_op_threads()
    assert torch.get_num_threads() == DEFAULT_THREADS == 1
    assert line is not None and line.startswith("1 intra-op CPU thread(s) per process, torchfold's default")
    assert set_intra_op_threads() is None  # said already, and still ours: kept


def test_the_users_choice_is_kept_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in threads.THREAD_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_said", None)
    monkeypatch.setattr(threads, "_AT_IMPORT", 3)
    torch.set_num_threads(2)  # by the user, after torchfold was imported
    assert (
        set_intra_op_threads()
        == "2 intra-op CPU thread(s) per process (kept: torch.set_num_threads was called)"
    )
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert set_intra_op_threads() == "2 intra-op CPU thread(s) per process (kept: OMP_NUM_THREADS is set)"
    assert set_intra_op_threads(1) == "1 intra-op CPU thread(s) per process (num_threads=1)"
    assert torch.get_num_threads() == 1
