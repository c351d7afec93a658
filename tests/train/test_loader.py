"""StepLoader: PopTorch batching, disjoint ranks, leftovers, trace steps, workers, exact resume, shutdown."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from _loader_worker import (
    TwoArgumentError,
    failing_build,
    raising_build,
    slow_build,
    square_build,
    wrong_build,
)
from _loop_worker import sst_trees

from torchfold.examples.datasets import Vocab
from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
from torchfold.train.data.loader import StepLoader
from torchfold.train.data.sampler import TraceBatchSampler

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


class Squares(torch.nn.Module):
    def square(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def _indices(loader: StepLoader) -> list[list[list[int]]]:
    return [[mb.indices for mb in step] for step in loader]


def _flat(steps: list[list[list[int]]]) -> list[int]:
    return [i for step in steps for mb in step for i in mb]


@pytest.mark.parametrize(
    ("size", "batch", "drop_last", "sizes"),
    [
        (101, 6, False, [6] * 16 + [5]),
        (101, 6, True, [6] * 16),
        (12, 6, False, [6, 6]),
        (7, 7, False, [7]),
    ],
)
def test_leftovers_are_a_smaller_step_or_dropped_never_lost_or_repeated(
    size: int, batch: int, drop_last: bool, sizes: list[int]
) -> None:
    loader = StepLoader(list(range(size)), batch, drop_last=drop_last, seed=1)
    assert len(loader) == len(sizes)
    steps = _indices(loader)
    assert [sum(len(mb) for mb in step) for step in steps] == sizes
    seen = _flat(steps)
    assert len(seen) == len(set(seen)) == size - loader.dropped_samples
    assert loader.dropped_samples == (size - sum(sizes) if drop_last else 0)


@pytest.mark.parametrize(("batch", "accumulation"), [(4, 1), (3, 2), (5, 3)])
def test_ranks_read_disjoint_parts_of_one_seeded_permutation(batch: int, accumulation: int) -> None:
    def epoch(e: int) -> list[list[int]]:
        per_rank = []
        for rank in range(3):
            loader = StepLoader(
                list(range(100)),
                batch,
                num_replicas=3,
                rank=rank,
                gradient_accumulation=accumulation,
                seed=7,
            )
            loader.set_epoch(e)
            steps = list(loader)
            assert all(len(step) <= accumulation for step in steps)
            assert all(step.batch_size <= batch * 3 * accumulation for step in steps)
            per_rank.append([i for step in steps for mb in step for i in mb.indices])
        return per_rank

    first, again, second = epoch(0), epoch(0), epoch(1)
    assert first == again  # seeded: the same on every process
    assert sorted(i for rank in first for i in rank) == list(range(100))  # disjoint, nothing lost
    assert sorted(i for rank in second for i in rank) == list(range(100))
    assert first != second  # set_epoch changes the order


def test_the_split_settings_are_read_from_the_sampler() -> None:
    fixed = StepLoader(list(range(20)), 2, num_replicas=2, rank=1)
    settings = (fixed.minibatch_size, fixed.max_device_batch_size, fixed.num_replicas, fixed.rank)
    assert settings == (2, None, 2, 1)
    assert fixed.sampler.minibatch_size == 2 and fixed.sampler.num_replicas == 2
    elastic = StepLoader(list(range(20)), trace=8, max_device_batch_size=3)
    assert (elastic.minibatch_size, elastic.max_device_batch_size, elastic.num_replicas) == (None, 3, 1)


def test_poptorch_sizes_and_the_combined_batch() -> None:
    loader = StepLoader(
        list(range(200)),
        2,
        device_iterations=3,
        num_replicas=2,
        rank=1,
        gradient_accumulation=4,
        seed=0,
    )
    assert loader.combined_batch_size == 2 * 3 * 2 * 4
    assert len(loader) == 13  # 12 steps of 16 and one of the 8 left
    steps = list(loader)
    assert len(steps) == 13 and len(loader) == 13 and loader.steps()[0].epoch == 1  # next: epoch 1
    assert all(len(step) == 4 and step.batch_size == 16 for step in steps[:-1])
    assert steps[-1].batch_size == 8 and len(steps[-1]) == 2 and steps[-1].split.num_minibatches == 4


def test_trace_mode_yields_the_samplers_minibatches_step_by_step() -> None:
    trace = [12, 6, 18, 30, 6, 24, 12, 18, 36]
    for rank in range(2):
        loader = StepLoader(list(range(100)), 6, trace=trace, num_replicas=2, rank=rank, seed=3)
        sampler = TraceBatchSampler(100, trace, 6, num_replicas=2, rank=rank, seed=3)
        steps = list(loader)
        assert [step.split for step in steps] == sampler.steps()
        assert [mb.indices for step in steps for mb in step] == list(sampler)
        assert [len(step) for step in steps] == [p.local_minibatches for p in sampler.steps()]
        assert any(len(step) > 1 for step in steps)
        assert any(len(step) == 0 for step in steps) == (rank == 1)  # steps of 6: one minibatch, rank 0's


def _tree_steps(loader: StepLoader, model: torch.nn.Module) -> list[tuple[list[int], list[float]]]:
    out = []
    for step in loader:
        for mb in step:
            plan, targets = mb.data
            out.append((mb.indices, [tree_lstm_loss(model, plan.apply(model), targets).item()]))
    return out


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_build_the_same_plans_as_the_training_process(context: str) -> None:
    trees = sst_trees(60)
    vocab = Vocab.build(trees)
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 8, 8).double()
    build = TreeLSTMBuild(vocab)
    in_process = _tree_steps(StepLoader(trees, 6, build=build, trace=[12, 18, 30], seed=2), model)
    workers = 2 if context == "fork" else 1  # a spawned worker imports torch: seconds
    with StepLoader(
        trees,
        6,
        build=build,
        trace=[12, 18, 30],
        seed=2,
        num_workers=workers,
        multiprocessing_context=context,
    ) as loader:
        assert _tree_steps(loader, model) == in_process


def test_state_dict_resumes_mid_epoch_exactly_with_workers_in_flight() -> None:
    trace = [6, 12, 18, 6, 24, 12, 6, 18, 36, 30, 24, 12]  # epoch 1: steps 8..11, the last cut to 10

    def loader() -> StepLoader:
        return StepLoader(
            list(range(100)),
            2,
            build=square_build,
            trace=trace,
            seed=5,
            num_workers=2,
            prefetch_factor=4,
            drop_last=False,
        )

    with loader() as whole:
        whole.set_epoch(1)
        expected = _indices(whole)
    with loader() as first:
        first.set_epoch(1)
        got, it = [], iter(first)
        for _ in range(2):  # workers are building the next steps meanwhile
            got.append([mb.indices for mb in next(it)])
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    with loader() as resumed:
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        resumed.set_epoch(1)  # the resumed epoch: keeps the position
        assert len(resumed) == len(expected) - 2
        got += _indices(resumed)
    assert got == expected
    assert sorted(i for step in got for mb in step for i in mb) == list(range(100))


def test_iterating_again_goes_on_from_the_last_step_handed_out() -> None:
    loader = StepLoader(list(range(30)), 3, seed=0)
    it = iter(loader)
    head = [next(it).step for _ in range(4)]
    assert [step.step for step in loader] == list(range(4, 10))
    assert head == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="superseded"):
        next(it)
    assert (
        len(loader) == 10 and loader.steps()[0].epoch == 1
    )  # the epoch is over: the next iter() is epoch 1's
    assert [step.step for step in loader] == list(range(10, 20))
    loader.set_epoch(2)  # set_epoch after the roll-over works as before
    assert [step.step for step in loader] == list(range(20, 30))


def test_every_iteration_is_a_full_pass_without_set_epoch() -> None:
    # `for epoch in range(3): for step in loader:` once trained one epoch, then two empty ones.
    loader = StepLoader(list(range(12)), 2, seed=5)
    passes = [[mb.indices for step in loader for mb in step] for _ in range(3)]
    assert [sorted(i for mb in p for i in mb) for p in passes] == [list(range(12))] * 3
    assert len({str(p) for p in passes}) == 3  # each pass is a new epoch: a new permutation
    assert loader.epoch == 2
    expected = StepLoader(list(range(12)), 2, seed=5)
    expected.set_epoch(1)
    assert passes[1] == [mb.indices for step in expected for mb in step]


def test_set_epoch_docs_say_what_iteration_does() -> None:
    # They once warned that without set_epoch "every epoch yields the same order", which the
    # roll-over (the test above) made untrue.
    doc = StepLoader.set_epoch.__doc__ or ""
    assert "same order" not in doc
    assert "the next ``iter()`` starts the next epoch with its own permutation" in " ".join(doc.split())


def test_a_state_saved_at_an_epoch_end_resumes_with_the_next_epoch() -> None:
    loader = StepLoader(list(range(12)), 2, seed=5)
    list(loader)
    state = loader.state_dict()
    expected = [mb.indices for step in loader for mb in step]
    assert len(expected) == 6  # epoch 1
    resumed = StepLoader(list(range(12)), 2, seed=5)
    resumed.load_state_dict(state)
    assert [mb.indices for step in resumed for mb in step] == expected


def test_iterating_past_a_bounded_trace_names_the_trace() -> None:
    loader = StepLoader(list(range(8)), 2, trace=[4, 4, 4, 4])
    assert len(list(loader)) == 2 and len(list(loader)) == 2
    with pytest.raises(
        ValueError, match=r"handed out every step of its trace .* \(4 steps, the last in epoch 1\)"
    ):
        iter(loader)


def test_an_abandoned_iteration_with_workers_goes_on_exactly() -> None:
    with StepLoader(list(range(60)), 3, build=square_build, seed=4, num_workers=2) as loader:
        expected = _indices(loader)
    with StepLoader(
        list(range(60)), 3, build=square_build, seed=4, num_workers=2, prefetch_factor=3
    ) as loader:
        got = []
        for part in (2, 5, 1):
            it = iter(loader)  # a new iteration while the workers still build the old one's read-ahead
            got += [[mb.indices for mb in next(it)] for _ in range(part)]
        got += _indices(loader)
    assert got == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_build_error_is_raised_with_the_worker_traceback_and_the_items(num_workers: int) -> None:
    loader = StepLoader(list(range(40)), 4, build=failing_build, shuffle=False, num_workers=num_workers)
    with loader, pytest.raises(ValueError, match="item 13 is corrupt") as info:
        list(loader)
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "dataset indices [12, 13, 14, 15]" in text
    if num_workers:
        assert "DataLoader worker process" in text and "failing_build" in text  # the worker's traceback


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("unicode", UnicodeDecodeError),
        ("json", json.JSONDecodeError),
        ("subprocess", subprocess.CalledProcessError),
        ("user", TwoArgumentError),
    ],
)
def test_a_build_error_keeps_its_type_from_a_worker(num_workers: int, kind: str, error: type) -> None:
    # DataLoader rebuilds a worker's exception as type(message): these came back as RuntimeError.
    loader = StepLoader(
        list(range(12)),
        4,
        build=raising_build(kind),
        shuffle=False,
        num_workers=num_workers,
        multiprocessing_context="fork" if num_workers else None,
    )
    with loader, pytest.raises(error) as info:
        list(loader)
    assert type(info.value) is error
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "dataset indices [4, 5, 6, 7]" in notes
    if num_workers:
        assert "Traceback in DataLoader worker process 0" in notes and "_loader_worker.py" in notes
    if kind == "user":
        assert (info.value.path, info.value.line) == ("trees.txt", 7)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_stop_iteration_in_the_build_is_named_not_generator_raised(num_workers: int) -> None:
    loader = StepLoader(
        list(range(12)),
        4,
        build=raising_build("stop"),
        shuffle=False,
        num_workers=num_workers,
        multiprocessing_context="fork" if num_workers else None,
    )
    with (
        loader,
        pytest.raises(
            RuntimeError,
            match=r"build raised StopIteration for the minibatch of dataset indices \[4, 5, 6, 7\]",
        ) as info,
    ):
        list(loader)
    assert isinstance(info.value.__cause__, StopIteration)


def test_a_build_returning_the_wrong_type_is_named() -> None:
    loader = StepLoader(list(range(8)), 4, build=wrong_build, shuffle=False)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"build returned list for the minibatch of dataset indices \[0, 1, 2, 3\]"
    ):
        list(loader)


def test_device_moves_numpy_targets_to_tensors() -> None:
    loader = StepLoader(list(range(6)), 3, build=square_build, shuffle=False, device="cpu")
    step = next(iter(loader))
    plan, targets = step.minibatches[0].data
    assert isinstance(targets, torch.Tensor) and targets.tolist() == [0, 1, 2]
    assert plan.apply(Squares())[0].tolist() == [0.0, 1.0, 4.0]


def _script(path: Path, body: str) -> Path:
    """A Python script at ``path`` running ``body`` (dedented) that can import ``tests/helpers/_loader_worker``."""
    path.write_text(f"import sys\nsys.path.insert(0, {str(HELPERS)!r})\n{textwrap.dedent(body)}")
    return path


def _children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def test_early_break_and_close_leave_no_worker() -> None:
    before = _children()
    loader = StepLoader(list(range(60)), 2, build=slow_build, num_workers=2, prefetch_factor=2)
    for step in loader:
        assert step.step == 0
        break
    assert _children() - before  # persistent workers wait for the next epoch...
    loader.close()
    assert _children() == before  # ...until close()
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_keyboard_interrupt_leaves_no_orphan_process(tmp_path: Path) -> None:
    script = _script(
        tmp_path / "interrupted.py",
        """
        import multiprocessing
        import signal
        from _loader_worker import slow_build
        from torchfold.train import StepLoader
        if __name__ == "__main__":
            # Ctrl-C as in a terminal, whatever this test was started under: a shell's background
            # job (``cmd &``, nohup) ignores SIGINT, and Python then installs no handler for it.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            loader = StepLoader(list(range(400)), 2, build=slow_build, num_workers=2)
            for step in loader:
                pids = [p.pid for p in multiprocessing.active_children()]
                print(*pids, flush=True)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    assert proc.stdout is not None
    workers = [int(pid) for pid in proc.stdout.readline().split()]
    assert len(workers) == 2
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, (
        f"exit status {proc.returncode}, stderr:\n{err[-2000:]}"
    )
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"minibatch_size": 40},
            ValueError,
            r"combined batch size .* = 40 is larger than the dataset \(30 items\)",
        ),
        (
            {
                "minibatch_size": 4,
                "num_replicas": 2,
                "device_iterations": 2,
                "gradient_accumulation": 2,
            },
            ValueError,
            r"4 \* 2 \* 2 \* 2 = 32 is larger than the dataset",
        ),
        ({"device_iterations": 0}, ValueError, "device_iterations must be a positive int, got 0"),
        ({"num_replicas": True}, TypeError, "num_replicas must be an int, got bool True"),
        ({"gradient_accumulation": 1.5}, TypeError, "gradient_accumulation must be an int, got float 1.5"),
        (
            {"minibatch_size": 4, "trace": [12, 10]},
            ValueError,
            "batch size 10 is not a multiple of minibatch_size=4",
        ),
        ({"trace": [4], "gradient_accumulation": 2}, ValueError, "leave gradient_accumulation=1"),
        ({"prefetch_factor": 2}, ValueError, "pass num_workers >= 1"),
        ({"build": "plan"}, TypeError, "build must be callable"),
        (
            {"build": lambda items: items, "num_workers": 1, "multiprocessing_context": "spawn"},
            TypeError,
            "cannot be pickled for 'spawn' worker processes",
        ),
        (
            {"rank": 2, "num_replicas": 2},
            ValueError,
            r"Invalid rank 2, rank should be in the interval \[0, 1\]",
        ),
    ],
)
def test_bad_arguments_fail_before_any_worker_starts(
    kwargs: dict, error: type[Exception], match: str
) -> None:
    before = _children()
    with pytest.raises(error, match=match):
        StepLoader(list(range(30)), **kwargs)
    assert _children() == before


def test_targets_are_safe_to_keep() -> None:
    with StepLoader(list(range(12)), 3, build=square_build, shuffle=False, num_workers=1) as loader:
        kept = [mb.data[1] for step in loader for mb in step]
    assert [t.tolist() for t in kept] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert all(isinstance(t, np.ndarray) for t in kept)
    assert Counter(len(t) for t in kept) == {3: 4}


@pytest.mark.parametrize("num_workers", [0, 1])
def test_iterating_leaves_the_global_generators_alone(num_workers: int) -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with StepLoader(list(range(20)), 4, build=square_build, num_workers=num_workers) as loader:
        for _ in range(2):
            list(loader)
            loader.set_epoch(loader.epoch + 1)
    torch.testing.assert_close(torch.rand(3), expected)


def test_an_exception_that_cannot_be_pickled_comes_back_with_its_type_and_message() -> None:
    import threading

    from torchfold.train.data.loader import _portable

    class Locked(Exception):  # local: pickling by reference fails too
        pass

    error = ValueError("bad tree")
    error.lock = threading.Lock()  # type: ignore[attr-defined]
    back = _portable(error, str(error))
    assert type(back) is ValueError and str(back) == "bad tree" and back is not error
    unprintable = TwoArgumentError("trees.txt", 7)  # its __str__ needs what only __init__ sets
    unprintable.lock = threading.Lock()  # type: ignore[attr-defined]
    assert repr(_portable(unprintable, "trees.txt, line 7: bad tree")) == (
        "RuntimeError('TwoArgumentError: trees.txt, line 7: bad tree')"
    )
    fallback = _portable(Locked("x"), "x")
    assert type(fallback) is RuntimeError and str(fallback) == "Locked: x"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"timeout": 1},
            ValueError,
            r"timeout=1 bounds the wait .* num_workers=0 starts none; pass num_workers >= 1",
        ),
        ({"timeout": -1, "num_workers": 1}, ValueError, "timeout must be a number of seconds >= 0"),
        ({"seed": 2**80}, ValueError, r"seed must be an int from 0 to 2\*\*63 - 1"),
    ],
)
def test_bad_arguments_are_refused_at_construction_in_one_line(kwargs: dict, error: type, match: str) -> None:
    # timeout without workers was a raw AssertionError from DataLoader at the first iteration;
    # seed=2**80 was "Overflow when unpacking long long".
    with pytest.raises(error, match=match) as info:
        StepLoader(list(range(8)), 2, **kwargs)
    assert "\n" not in str(info.value)


def test_a_resume_state_with_a_string_step_is_named() -> None:
    loader = StepLoader(list(range(8)), 2)
    state = loader.state_dict()
    state["sampler"]["next_step"] = "1"
    with pytest.raises(TypeError, match=r"sampler state's 'next_step' must be an int, got str '1'"):
        loader.load_state_dict(state)


def test_an_unclosed_loader_is_not_closed_by_a_forked_worker(tmp_path: Path) -> None:
    # A worker forked by a second loader inherits the first one; collecting it there called
    # DataLoader's shutdown from a process that is not the workers' parent.
    script = _script(
        tmp_path / "unclosed.py",
        """
        import gc
        from _loader_worker import collecting_build, failing_build
        from torchfold.train.data.loader import StepLoader
        gc.disable()  # only the worker's gc.collect() collects the first loader
        first = StepLoader(list(range(40)), 4, build=failing_build, shuffle=False, num_workers=1,
                           multiprocessing_context="fork")
        try:
            list(first)
        except ValueError:
            pass
        first.cycle = first  # unreachable once the name goes, but alive until a collection
        del first
        second = StepLoader(list(range(8)), 4, build=collecting_build, num_workers=1, multiprocessing_context="fork")
        assert sum(len(step) for step in second) == 2
        second.close()
        gc.collect()  # here, in its own process, the first loader stops its worker
        print("ok")
        """,
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr and "child process" not in done.stderr, done.stderr[-2000:]


def test_a_trace_shorter_than_one_epoch_trains_its_steps() -> None:
    # It raised at construction, advising "fewer epochs" than 0.
    loader = StepLoader(list(range(64)), 16, trace=[32, 16])
    steps = [sorted(i for mb in step for i in mb.indices) for step in loader]
    assert [len(s) for s in steps] == [32, 16] and len(set(steps[0] + steps[1])) == 48
    assert loader.num_epochs == 1


def test_the_train_cli_trains_on_a_trace_shorter_than_one_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchfold.cli import main

    trace = tmp_path / "short.csv"
    trace.write_text("step,batchsize\n0,32\n1,16\n")
    args = ["train", "--trace", str(trace), "--generate", "64", "--minibatch-size", "16", "--max-steps", "1"]
    main([*args, "--no-progress", "--threads", "1", "--workers", "0"])
    assert "done: 1 steps (32 samples" in capsys.readouterr().out


def test_minibatch_size_is_the_per_replica_name_and_batch_size_a_deprecated_alias() -> None:
    # batch_size means a step's global batch (Step.batch_size); the loader's per-replica size is
    # minibatch_size, positional as before; the old keyword and attribute still work with a FutureWarning.
    positional = StepLoader(list(range(12)), 3, trace=[6, 6], shuffle=False)
    keyword = StepLoader(list(range(12)), minibatch_size=3, trace=[6, 6], shuffle=False)
    with pytest.warns(FutureWarning, match=r"StepLoader\(batch_size=\) is deprecated; use minibatch_size="):
        old = StepLoader(list(range(12)), batch_size=3, trace=[6, 6], shuffle=False)
    for loader in (positional, keyword, old):
        assert loader.minibatch_size == 3 and "minibatch_size=3" in repr(loader)
        assert [[mb.num_samples for mb in step] for step in loader] == [[3, 3], [3, 3]]
    with pytest.warns(
        FutureWarning, match=r"StepLoader.batch_size is deprecated; use StepLoader.minibatch_size"
    ):
        assert old.batch_size == 3
    with pytest.raises(TypeError, match="give minibatch_size=3, not also the deprecated batch_size=4"):
        StepLoader(list(range(12)), 3, batch_size=4)


def test_num_replicas_is_the_process_count_and_replication_factor_a_deprecated_alias() -> None:
    # torch's DistributedSampler word; PopTorch's replication_factor still works with a FutureWarning.
    new = [
        StepLoader(list(range(12)), 2, trace=[4, 8], num_replicas=2, rank=r, shuffle=False) for r in (0, 1)
    ]
    with pytest.warns(
        FutureWarning, match=r"StepLoader\(replication_factor=\) is deprecated; use num_replicas="
    ):
        old = [
            StepLoader(list(range(12)), 2, trace=[4, 8], replication_factor=2, rank=r, shuffle=False)
            for r in (0, 1)
        ]
    for a, b in zip(new, old, strict=True):
        assert a.num_replicas == b.num_replicas == 2
        assert [[mb.indices for mb in s] for s in a] == [[mb.indices for mb in s] for s in b]
    with pytest.warns(
        FutureWarning, match=r"StepLoader.replication_factor is deprecated; use StepLoader.num_replicas"
    ):
        assert old[0].replication_factor == 2
    with pytest.raises(TypeError, match="give num_replicas=2, not also the deprecated replication_factor=3"):
        StepLoader(list(range(12)), 2, num_replicas=2, replication_factor=3)


def test_layout_examples_hold_one_minibatch_of_each_layout_a_pass_makes() -> None:
    from torchfold import StaticShapesOverflow
    from torchfold.train import fit_static_shapes

    trees = sst_trees(60)
    vocab = Vocab.build(trees)
    shapes = fit_static_shapes(trees, TreeLSTMBuild(vocab), 5)  # depth buckets: several layouts
    counters = (shapes.plans, shapes.real_calls, shapes.padded_calls)
    loader = StepLoader(trees, 5, build=TreeLSTMBuild(vocab, shapes=shapes), trace=[10])
    examples = loader.layout_examples()
    keys = [example.data[0].layout.key for example in examples]
    assert len(set(keys)) == len(keys) >= 2
    # every minibatch of the pass (split where it does not fit) has one of those layouts
    order = np.random.default_rng(0).permutation(len(trees)).tolist()
    build = TreeLSTMBuild(vocab, shapes=shapes)
    for start in range(0, len(trees), 5):
        items = [trees[i] for i in order[start : start + 5]]
        try:
            plans = [build(items)[0]]
        except StaticShapesOverflow:
            plans = [build(items[:3])[0], build(items[3:])[0]]
        assert all(plan.layout.key in keys for plan in plans)
        assert all(len(example.indices) == example.num_samples for example in examples)
    shapes.plans, shapes.real_calls, shapes.padded_calls = counters  # (the check above counted)
    # the loader's envelope was left as it was: its copy did the building
    assert loader.layout_examples(max_minibatches=1)[0].data[0].layout.key in keys
    assert (shapes.plans, shapes.real_calls, shapes.padded_calls) == counters
    assert StepLoader(trees, 5, trace=[10]).layout_examples() == []  # no build: no plan, no layout
    with pytest.raises(ValueError, match=r"layout_examples\(max_minibatches\)"):
        loader.layout_examples(max_minibatches=0)


class _CachedBuild(TreeLSTMBuild):
    """A build with a cache behind a lock, as a tokenizer's: ``copy.deepcopy`` cannot copy the lock."""

    def __init__(self, vocab: Vocab, shapes: object) -> None:
        super().__init__(vocab, shapes=shapes)  # type: ignore[arg-type]
        self.lock = threading.Lock()
        self.cache: dict[int, int] = {}

    def __call__(self, trees: list[object], shapes: object = None) -> object:  # type: ignore[override]
        with self.lock:
            self.cache[len(trees)] = self.cache.get(len(trees), 0) + 1
        return super().__call__(trees, shapes)  # type: ignore[arg-type]


def test_layout_examples_of_a_build_holding_a_lock_share_the_lock_and_leave_the_envelope_alone() -> None:
    """The warm-up's copy of the build (which keeps the envelope as training left it) once failed on
    the build's lock (``cannot pickle '_thread.lock' object``, after the first step on XLA): the
    lock is now shared with the copy, everything else copied as before."""
    from torchfold.train import fit_static_shapes

    trees = sst_trees(60)
    vocab = Vocab.build(trees)
    shapes = fit_static_shapes(trees, TreeLSTMBuild(vocab), 5)
    counters = (shapes.version, shapes.plans, shapes.real_calls, shapes.padded_calls)
    plain = StepLoader(trees, 5, build=TreeLSTMBuild(vocab, shapes=shapes), trace=[10]).layout_examples()
    assert (shapes.version, shapes.plans, shapes.real_calls, shapes.padded_calls) == counters
    build = _CachedBuild(vocab, shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the examples are all there
        examples = StepLoader(trees, 5, build=build, trace=[10]).layout_examples()
    assert len(examples) >= 2
    assert [e.data[0].layout.key for e in examples] == [e.data[0].layout.key for e in plain]
    assert [e.indices for e in examples] == [e.indices for e in plain]
    # the copy built them: the build's envelope and cache are as they were
    assert (shapes.version, shapes.plans, shapes.real_calls, shapes.padded_calls) == counters
    assert build.cache == {}
    assert not build.lock.locked()


class _UncopyableBuild(TreeLSTMBuild):
    """A build holding what ``copy.deepcopy`` cannot copy, and a copy may not share: a generator."""

    def __init__(self, vocab: Vocab, shapes: object) -> None:
        super().__init__(vocab, shapes=shapes)  # type: ignore[arg-type]
        self.ids = (i for i in range(10**6))


def test_layout_examples_of_a_build_that_cannot_be_copied_are_none_with_one_warning_saying_why() -> None:
    from torchfold.train import fit_static_shapes

    trees = sst_trees(20)
    vocab = Vocab.build(trees)
    shapes = fit_static_shapes(trees, TreeLSTMBuild(vocab), 5)
    loader = StepLoader(trees, 5, build=_UncopyableBuild(vocab, shapes), trace=[10])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loader.layout_examples() == []
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert (
        "the build (_UncopyableBuild) cannot be copied (TypeError: cannot pickle 'generator' object)"
        in message
    )
    assert "Give _UncopyableBuild a __deepcopy__" in message
    assert [len(mb.indices) for step in loader for mb in step] == [5, 5]  # training goes on


@pytest.mark.parametrize(
    ("trace", "sizes"),
    [("linear:4:12:3", [4, 8, 12]), ("steps:4x2,8x1", [4, 4, 8]), ("4,8,4", [4, 8, 4]), ("8", [8, 8, 8, 8])],
)
def test_trace_takes_the_strings_of_the_command_line(trace: str, sizes: list[int]) -> None:
    """``trace="linear:32:256:60"`` once raised a bare FileNotFoundError (every string was a CSV path)."""
    loader = StepLoader(list(range(32)), 4, trace=trace, shuffle=False)
    assert [sum(len(mb.indices) for mb in step) for step in loader][: len(sizes)] == sizes
