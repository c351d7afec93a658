"""Tests for torchfold.train.data.sampler.TraceBatchSampler: partition properties, plans, resume, errors."""

from __future__ import annotations

import inspect
import json
import os
import re
import socket
import subprocess
import sys
from itertools import chain
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

import torchfold._deprecation
from torchfold.train.data.sampler import StepSplit, TraceBatchSampler, TraceMismatch, minibatches_per_rank
from torchfold.train.schedule.trace import BatchSizeTrace

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example_trace(traces_dir: Path) -> Path:
    """The shared example trace (``traces_dir`` fails, never skips, when it is missing)."""
    return traces_dir / "step_batchsize_example.csv"


def all_ranks(num_replicas: int, **kwargs: object) -> list[TraceBatchSampler]:
    return [TraceBatchSampler(num_replicas=num_replicas, rank=r, **kwargs) for r in range(num_replicas)]  # type: ignore[arg-type]


def check_epoch(samplers: list[TraceBatchSampler], complete: bool = True) -> list[list[int]]:
    """Check one epoch (from its resume point) across all ranks; return each step's global batch.

    ``complete``: the samplers start at the epoch's first step, so the epoch covers the dataset.
    """
    s0 = samplers[0]
    world = s0.num_replicas
    yielded = [list(s) for s in samplers]
    plans = [s.steps() for s in samplers]
    for s, batches in zip(samplers, yielded, strict=True):
        assert len(s) == len(batches)  # __len__ is true
    # Every rank sees the same step structure.
    for p in plans[1:]:
        assert [(q.step, q.batch_size, q.minibatches) for q in p] == [
            (q.step, q.batch_size, q.minibatches) for q in plans[0]
        ]
    positions = [0] * world
    steps = []
    seen: set[int] = set()
    for i, plan in enumerate(plans[0]):
        per_rank = []
        for r in range(world):
            local = plans[r][i]
            assert local.rank == r
            if s0.minibatch_size is not None:
                assert local.minibatches == minibatches_per_rank(plan.batch_size, s0.minibatch_size, world)
            mine = yielded[r][positions[r] : positions[r] + local.local_minibatches]
            positions[r] += local.local_minibatches
            assert sum(len(b) for b in mine) == local.local_samples
            assert all(len(b) >= 1 for b in mine)  # never an empty or fake minibatch
            per_rank.append(mine)
        # Minibatch j of the step is on rank j % world
        ordered = [per_rank[j % world][j // world] for j in range(plan.num_minibatches)]
        lengths = [len(b) for b in ordered]
        assert lengths == s0.minibatch_sizes(plan.batch_size)
        if s0.minibatch_size is not None:  # all but the last are full
            m = s0.minibatch_size
            assert all(n == m for n in lengths[:-1]) and 1 <= lengths[-1] <= m
        else:  # as few per rank as the maximum allows, as even as possible
            most = s0.max_device_batch_size
            assert most is not None and max(lengths) <= most and max(lengths) - min(lengths) <= 1
            assert max(local.minibatches) == -(-plan.batch_size // (world * most))
        batch = [i for b in ordered for i in b]
        assert len(batch) == plan.batch_size  # the ranks' minibatches sum to the global batch
        assert seen.isdisjoint(batch)  # every index at most once per epoch
        seen.update(batch)
        steps.append(batch)
    assert positions == [len(y) for y in yielded]  # the plan accounts for every minibatch
    order = [i for batch in steps for i in batch]
    for s in samplers:  # .sampler: the order the steps take the indices in, the same on every rank
        assert list(s.sampler) == order and len(s.sampler) == len(order)
    assert seen <= set(range(s0.dataset_size))
    if complete and not s0.drop_last:
        assert seen == set(range(s0.dataset_size))
    return steps


@st.composite
def setups(draw: st.DrawFn) -> dict[str, object]:
    m = draw(st.integers(1, 5))
    per_device_maximum = draw(st.booleans())  # else a fixed minibatch size
    multiple = 1 if per_device_maximum else m
    sizes = draw(st.lists(st.integers(1, 12).map(lambda k: k * multiple), min_size=1, max_size=40))
    return {
        ("max_device_batch_size" if per_device_maximum else "minibatch_size"): m,
        "trace": sizes,
        "dataset": draw(st.integers(1, min(120, sum(sizes)))),  # the trace covers at least one epoch
        "num_replicas": draw(st.integers(1, 6)),
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
        "drop_last": draw(st.booleans()),
    }


def covered_epochs(setup: dict[str, object]) -> int:
    trace = BatchSizeTrace(setup["trace"])  # type: ignore[arg-type]
    if setup["drop_last"] and max(trace) > setup["dataset"]:  # type: ignore[operator]
        return 0
    return min(3, trace.num_full_epochs(setup["dataset"], drop_last=setup["drop_last"]))  # type: ignore[arg-type]


@settings(max_examples=80, deadline=None)
@given(setup=setups())
def test_partition_properties(setup: dict[str, object]) -> None:
    num_epochs = covered_epochs(setup)
    assume(num_epochs > 0)
    world = setup.pop("num_replicas")
    samplers = all_ranks(world, **setup)  # type: ignore[arg-type]
    single = TraceBatchSampler(num_replicas=1, rank=0, **setup)  # type: ignore[arg-type]
    next_first = 0
    for epoch in range(num_epochs):
        for s in [*samplers, single]:
            s.set_epoch(epoch)
        steps = check_epoch(samplers)
        assert samplers[0].steps()[0].step == next_first  # the step counter is global
        next_first = samplers[0].steps()[-1].step + 1
        # The global batch of each step does not depend on the world size (nor, with a
        # minibatch size, its minibatches)
        alone = check_epoch([single])
        assert [sorted(b) for b in steps] == [sorted(b) for b in alone]
        if single.minibatch_size is not None:
            assert steps == alone
            assert [p.local_minibatches for p in single.steps()] == [
                p.num_minibatches for p in samplers[0].steps()
            ]
        # Deterministic: a fresh sampler with the same arguments yields the same.
        fresh = TraceBatchSampler(num_replicas=world, rank=world - 1, **setup)  # type: ignore[arg-type]
        fresh.set_epoch(epoch)
        assert list(fresh) == list(samplers[-1])


@settings(max_examples=60, deadline=None)
@given(setup=setups(), data=st.data())
def test_resume_mid_epoch_equals_uninterrupted(setup: dict[str, object], data: st.DataObject) -> None:
    num_epochs = covered_epochs(setup)
    assume(num_epochs > 0)
    world = setup.pop("num_replicas")
    epoch = data.draw(st.integers(0, num_epochs - 1))
    rank = data.draw(st.integers(0, world - 1))  # type: ignore[arg-type]
    saver = TraceBatchSampler(num_replicas=world, rank=data.draw(st.integers(0, world - 1)), **setup)  # type: ignore[arg-type]
    saver.set_epoch(epoch)
    plans = saver.steps()
    done = data.draw(st.integers(0, len(plans)))  # steps completed before the "crash"
    next_step = plans[0].step + done
    saver.seek(next_step)
    state = saver.state_dict()
    assert state == json.loads(json.dumps(state))  # plain data

    uninterrupted = TraceBatchSampler(num_replicas=world, rank=rank, **setup)  # type: ignore[arg-type]
    uninterrupted.set_epoch(epoch)
    full = uninterrupted.steps()
    skipped = sum(p.local_minibatches for p in full[:done])
    expected = list(uninterrupted)[skipped:]

    resumed = TraceBatchSampler(num_replicas=world, rank=rank, **setup)  # type: ignore[arg-type]
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)  # the usual loop calls it again: the position is kept
    assert resumed.epoch == epoch
    assert list(resumed) == expected
    assert len(resumed) == len(expected)
    assert resumed.steps() == full[done:]
    if epoch + 1 < num_epochs:  # and the next epoch is as if nothing happened
        resumed.set_epoch(epoch + 1)
        uninterrupted.set_epoch(epoch + 1)
        assert list(resumed) == list(uninterrupted)

    # On another number of ranks, the resumed steps hold the same samples
    other_world = data.draw(st.integers(1, 6))
    others = all_ranks(other_world, **setup)  # type: ignore[arg-type]
    for other in others:
        other.load_state_dict(state)
        other.set_epoch(epoch)
    fresh = all_ranks(world, **setup)  # type: ignore[arg-type]
    for sampler in fresh:
        sampler.set_epoch(epoch)
    expected_steps = check_epoch(fresh)[done:]
    assert [sorted(b) for b in check_epoch(others, complete=False)] == [sorted(b) for b in expected_steps]


def test_example_trace_8_replicas(example_trace: Path) -> None:
    trace = BatchSizeTrace.from_csv(example_trace)
    world, m, n = 8, 32, 60000
    samplers = all_ranks(world, dataset=n, trace=trace, minibatch_size=m, seed=3)
    first_steps = []
    for epoch in range(trace.num_full_epochs(n)):
        for s in samplers:
            s.set_epoch(epoch)
        plans = samplers[0].steps()
        first_steps.append(plans[0].step)
        everything = sorted(chain.from_iterable(chain.from_iterable(samplers)))
        assert everything == list(range(n))  # every sample exactly once per epoch
        assert sum(len(s) for s in samplers) == sum(p.num_minibatches for p in plans)
        for p in plans:
            assert sum(p.minibatches) * m >= p.batch_size > (sum(p.minibatches) - 1) * m
            assert p.batch_size == trace[p.step] or p is plans[-1]
    assert first_steps == [
        0,
        82,
        146,
        205,
        274,
        328,
        400,
        455,
        523,
        590,
        646,
        716,
    ]  # by hand: cumulative sums
    # The warm-up steps of 32..128 samples leave most ranks without a minibatch.
    plans = TraceBatchSampler(n, trace, m, num_replicas=world, rank=7).step_splits(0)
    assert [p.minibatches for p in plans[:8]] == [
        (1, 1, 1, 1, 0, 0, 0, 0),
        (1, 1, 1, 1, 0, 0, 0, 0),
        (1,) * 8,
        (1,) * 8,
        (1, 1, 0, 0, 0, 0, 0, 0),
        (1, 1, 0, 0, 0, 0, 0, 0),
        (1, 0, 0, 0, 0, 0, 0, 0),
        (1, 0, 0, 0, 0, 0, 0, 0),
    ]
    assert plans[20].minibatches == (2,) * 8  # 512 samples: 16 minibatches, 2 per rank
    assert plans[40].minibatches == (8,) * 8  # 2048 samples: 64 minibatches, 8 per rank
    assert samplers[0].num_epochs == 12  # the complete ones; the trace's last steps make a truncated 13th
    samplers[0].set_epoch(12)
    assert samplers[0].epoch_steps.truncated and samplers[0].epoch_steps.end_step == 810
    with pytest.raises(ValueError, match="too short"):
        samplers[0].set_epoch(13)


def test_dataloader_and_step_loop() -> None:
    """The documented loop: draw plan.local_minibatches batches per step, possibly none."""
    data = torch.arange(88.0).unsqueeze(1)  # the trace covers exactly one epoch
    trace = [8, 24, 4, 40, 12]
    seen = []
    for rank in range(3):
        sampler = TraceBatchSampler(TensorDataset(data), trace, minibatch_size=4, num_replicas=3, rank=rank)
        loader = DataLoader(TensorDataset(data), batch_sampler=sampler)
        assert len(loader) == len(sampler)
        batches = iter(loader)
        for plan in sampler.steps():
            for _ in range(plan.local_minibatches):
                (x,) = next(batches)
                assert x.shape == (4, 1)
                seen += x.flatten().long().tolist()
            assert isinstance(plan, StepSplit)
        with pytest.raises(StopIteration):
            next(batches)
    assert len(set(seen)) == len(seen) == 88


def test_shuffle_and_set_epoch_change_the_order() -> None:
    s = TraceBatchSampler(1000, 100, minibatch_size=10, seed=1)
    first = list(s)
    assert first == list(s)  # same epoch, same order
    s.set_epoch(1)
    second = list(s)
    assert first != second and sorted(chain(*first)) == sorted(chain(*second)) == list(range(1000))
    assert first != list(TraceBatchSampler(1000, 100, minibatch_size=10, seed=2))
    assert TraceBatchSampler(20, 10, minibatch_size=5).num_epochs is None  # an int trace never ends
    assert list(chain(*TraceBatchSampler(20, 10, minibatch_size=5, shuffle=False))) == list(range(20))


def _set_epoch_as_lightning_does(loader: DataLoader[Any], epoch: int) -> None:
    """Lightning's ``_set_sampler_epoch`` (and accelerate's ``DataLoaderDispatcher.set_epoch``): the
    loader's ``sampler`` and its ``batch_sampler.sampler``, never the batch sampler itself."""
    candidates = [loader.sampler, getattr(loader.batch_sampler, "sampler", None)]
    for obj in {id(o): o for o in candidates if o is not None}.values():
        set_epoch = getattr(obj, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def test_set_epoch_through_the_loaders_batch_sampler_sampler_moves_order_and_steps() -> None:
    trace = [8, 16, 4, 12, 12, 8, 20]  # two epochs of 40 samples
    sampler = TraceBatchSampler(40, trace, minibatch_size=4, seed=0)
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_sampler=sampler)
    assert not hasattr(loader.sampler, "set_epoch")  # the DataLoader's own SequentialSampler
    epochs = []
    for epoch in range(2):
        _set_epoch_as_lightning_does(loader, epoch)
        steps = sampler.steps()
        epochs.append(
            ([s.step for s in steps], [s.batch_size for s in steps], [x.tolist() for (x,) in loader])
        )
        reference = TraceBatchSampler(40, trace, minibatch_size=4, seed=0)
        reference.set_epoch(epoch)
        assert sampler.epoch == epoch and epochs[-1][2] == list(reference)
        assert sorted(chain(*epochs[-1][2])) == list(range(40))
    (steps0, sizes0, batches0), (steps1, sizes1, batches1) = epochs
    assert (steps0, sizes0, steps1, sizes1) == ([0, 1, 2, 3], [8, 16, 4, 12], [4, 5, 6], [12, 8, 20])
    assert list(chain(*batches0)) != list(chain(*batches1))  # a new permutation (seed + epoch)
    # accelerate's DataLoaderShard.set_epoch calls both the batch sampler's and its .sampler's: the same
    sampler.set_epoch(1)
    sampler.sampler.set_epoch(1)
    assert [x.tolist() for (x,) in loader] == batches1
    with pytest.raises(ValueError, match="too short"):  # a third epoch the trace does not cover: loud
        _set_epoch_as_lightning_does(loader, 2)


def test_minibatches_per_rank_table() -> None:
    assert minibatches_per_rank(256, 32, 3) == (3, 3, 2)
    assert minibatches_per_rank(20, 8, 4) == (1, 1, 1, 0)  # 8, 8, 4
    assert minibatches_per_rank(1, 8, 2) == (1, 0)


# -- argument checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_replicas": True}, TypeError, "num_replicas must be an int, got bool True"),
        ({"num_replicas": 0}, ValueError, "num_replicas must be a positive int, got 0"),
        ({"num_replicas": 2, "rank": 2}, ValueError, "Invalid rank 2, rank should be in the interval [0, 1]"),
        (
            {"num_replicas": 2, "rank": -1},
            ValueError,
            "Invalid rank -1, rank should be in the interval [0, 1]",
        ),
        ({"rank": False}, TypeError, "rank must be an int, got bool False"),
        ({"minibatch_size": 0}, ValueError, "minibatch_size must be a positive int, got 0"),
        ({"minibatch_size": 2.0}, TypeError, "minibatch_size must be an int, got float 2.0"),
        (
            {"minibatch_size": 3},
            ValueError,
            "<list>, step 0: batch size 8 is not a multiple of minibatch_size=3",
        ),
        ({"dataset": 0}, ValueError, "dataset size should be a positive integer, got 0"),
        ({"dataset": True}, TypeError, "dataset should be a dataset with len()"),
        ({"dataset": object()}, TypeError, "dataset should be a dataset with len()"),
        ({"shuffle": 1}, TypeError, "shuffle should be a bool, got int 1"),
        ({"drop_last": None}, TypeError, "drop_last should be a bool"),
        ({"seed": 1.5}, TypeError, "seed must be an int, got float 1.5"),
        (
            {"seed": 2**80},
            ValueError,
            "seed must be an int from 0 to 2**63 - 1 (9223372036854775807), got 1208925819614629174706176",
        ),
        ({"seed": -1}, ValueError, "seed must be an int >= 0, got -1"),
        ({"trace": [8, 9]}, ValueError, "<list>, step 1: batch size 9 is not a multiple of minibatch_size=4"),
    ],
)
def test_argument_errors(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    args: dict[str, object] = {"dataset": 16, "trace": [8, 8], "minibatch_size": 4, **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        TraceBatchSampler(**args)  # type: ignore[arg-type]


def test_trace_file_error_names_line(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("step,batchsize\n0,64\n1,96\n2,100\n")
    with pytest.raises(
        ValueError,
        match=re.escape(f"{path}, line 4 (step 2): batch size 100 is not a multiple of minibatch_size=32"),
    ):
        TraceBatchSampler(1000, path, minibatch_size=32)


def test_set_epoch_and_state_dict_errors() -> None:
    s = TraceBatchSampler(10, [4, 4, 4, 4, 4, 4], minibatch_size=2)
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        s.set_epoch(-1)
    for bad in (True, 1.0):  # one int check for the train half: check_int's TypeError
        with pytest.raises(TypeError, match=f"epoch must be an int, got {type(bad).__name__}"):
            s.set_epoch(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"next_step=4 is outside epoch 0, which runs steps 0\.\.2"):
        s.seek(4)
    with pytest.raises(TypeError, match="next_step must be an int"):
        s.seek(True)  # type: ignore[arg-type]
    assert s.state_dict()["next_step"] == 0
    s.seek(3)
    assert s.state_dict()["next_step"] == 3
    s.seek(1)
    next(iter(s))  # the first minibatch of step 1 (of 2 there): the step is not done
    assert s.state_dict()["next_step"] == 1
    s.set_epoch(1)
    assert s.state_dict()["next_step"] == 3  # a new epoch that has not started: its first step


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"trace": [6, 4, 4, 4, 4, 4]}, "its step 0 had batch size 4, and trace '<list>' has 6 there"),
        (
            {"minibatch_size": None, "max_device_batch_size": 2},
            "saved with minibatch_size=2 but this sampler has minibatch_size=None",
        ),
        ({"dataset": 12}, "saved with dataset_size=10 but this sampler has dataset_size=12"),
        ({"minibatch_size": 4}, "saved with minibatch_size=2 but this sampler has minibatch_size=4"),
        ({"seed": 5}, "saved with seed=0 but this sampler has seed=5"),
        ({"drop_last": True}, "saved with drop_last=False but this sampler has drop_last=True"),
        ({"shuffle": False}, "saved with shuffle=True but this sampler has shuffle=False"),
    ],
)
def test_load_state_dict_mismatch(other: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "dataset": 10,
        "trace": [4, 4, 4, 4, 4, 4],
        "minibatch_size": 2,
        "num_replicas": 2,
        "rank": 0,
    }
    saver = TraceBatchSampler(**args)  # type: ignore[arg-type]
    saver.seek(1)
    state = saver.state_dict()
    target = TraceBatchSampler(**{**args, **other})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape(message)):
        target.load_state_dict(state)


def test_load_state_dict_bad_states() -> None:
    s = TraceBatchSampler(10, [4, 4, 4, 4, 4, 4], minibatch_size=2)
    s.seek(2)
    good = s.state_dict()
    with pytest.raises(ValueError, match=re.escape("sampler state is missing ['next_step']")):
        s.load_state_dict({k: v for k, v in good.items() if k != "next_step"})
    with pytest.raises(ValueError, match="next_step=5, outside its epoch 0"):
        s.load_state_dict({**good, "next_step": 5, "trace_steps": [[4, 5]]})
    with pytest.raises(TypeError, match=r"sampler state's 'next_step' must be an int, got str '2'"):
        s.load_state_dict({**good, "next_step": "2"})  # once a raw TypeError from comparing str and int
    with pytest.raises(TypeError, match="state should be a dict"):
        s.load_state_dict([1])  # type: ignore[arg-type]


def test_resume_at_epoch_end_yields_nothing_until_next_epoch() -> None:
    s = TraceBatchSampler(10, [4, 4, 4, 4, 4, 4], minibatch_size=2, seed=4)
    s.seek(3)  # epoch 0 (steps 0..2) is complete
    state = s.state_dict()
    resumed = TraceBatchSampler(10, [4, 4, 4, 4, 4, 4], minibatch_size=2, seed=4)
    resumed.load_state_dict(state)
    assert list(resumed) == [] and len(resumed) == 0 and resumed.steps() == []
    resumed.set_epoch(1)
    s.set_epoch(1)
    assert list(resumed) == list(s)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


WORKER = """
import json, sys, torch.distributed as dist
from torchfold.train.data.sampler import TraceBatchSampler
dist.init_process_group("gloo", init_method="env://")
s = TraceBatchSampler(50, [6, 9, 3, 12, 30], minibatch_size=3, seed=7)  # world size and rank from dist
plans = [(p.step, p.minibatches, p.local_minibatches) for p in s.steps()]
print(json.dumps({"rank": s.rank, "world": s.num_replicas, "batches": list(s), "plans": plans}))
dist.destroy_process_group()
"""


def test_defaults_from_torch_distributed() -> None:
    """Two real gloo processes: num_replicas and rank come from torch.distributed."""
    world = 2
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True
        )
        for r in range(world)
    ]
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert [o["rank"] for o in outputs] == [0, 1] and all(o["world"] == world for o in outputs)
    expected = [
        list(TraceBatchSampler(50, [6, 9, 3, 12, 30], 3, num_replicas=2, rank=r, seed=7)) for r in range(2)
    ]
    assert [o["batches"] for o in outputs] == expected
    assert outputs[0]["plans"][2] == [2, [1, 0], 1] and outputs[1]["plans"][2] == [2, [1, 0], 0]


def test_a_trace_shorter_than_one_epoch_yields_its_steps() -> None:
    sampler = TraceBatchSampler(100, [8, 16], minibatch_size=8, shuffle=False)
    assert list(sampler) == [list(range(8)), list(range(8, 16)), list(range(16, 24))]
    assert [p.batch_size for p in sampler.steps()] == [8, 16] and sampler.num_epochs == 1


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_state_dict_takes_no_argument_and_tracks_the_position(num_replicas: int) -> None:
    # It took next_step=; PyTorch's stateful convention is state_dict() alone.
    assert list(inspect.signature(TraceBatchSampler.state_dict).parameters) == ["self"]
    args: dict[str, Any] = {"dataset": 40, "trace": [8, 4, 12, 8, 8], "minibatch_size": 2, "seed": 3}
    uninterrupted = TraceBatchSampler(**args, num_replicas=num_replicas, rank=0)
    expected = list(uninterrupted)
    for done in range(len(uninterrupted.steps()) + 1):  # the loop of the module docstring, rank 0
        sampler = TraceBatchSampler(**args, num_replicas=num_replicas, rank=0)
        batches, got = iter(sampler), []
        for plan in sampler.steps()[:done]:
            got += [next(batches) for _ in range(plan.local_minibatches)]
        state = sampler.state_dict()
        assert state["next_step"] == done
        resumed = TraceBatchSampler(**args, num_replicas=num_replicas, rank=0)
        resumed.load_state_dict(state)
        assert got + list(resumed) == expected


def test_step_plan_is_a_deprecated_alias_of_step_split() -> None:
    import warnings

    import torchfold.train as tt

    torchfold._deprecation._warned.discard("torchfold.train.StepPlan")  # it warns once per process
    with pytest.warns(
        FutureWarning, match=r"torchfold.train.StepPlan is deprecated; use torchfold.train.StepSplit"
    ):
        assert tt.StepPlan is StepSplit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tt.StepPlan is StepSplit  # once
    assert "StepPlan" not in tt.__all__ and "StepSplit" in tt.__all__
    sampler = TraceBatchSampler(8, [4, 4], minibatch_size=2)
    with pytest.warns(
        FutureWarning, match=r"step_plan\(\) is deprecated; use TraceBatchSampler.step_splits\(\)"
    ):
        assert sampler.step_plan() == sampler.step_splits()
    step = next(iter(tt.StepLoader(list(range(8)), 2, trace=[4, 4])))
    with pytest.warns(FutureWarning, match=r"Step.plan is deprecated; use Step.split"):
        assert step.plan is step.split


def test_a_longer_trace_resumes_where_the_state_left_off_as_one_sampler_of_it_would() -> None:
    """A state holds the batch sizes of the steps it took: a trace that begins with them (and goes on
    longer, or differs only later) is taken, and yields what an uninterrupted sampler of it yields."""
    saver = TraceBatchSampler(10, [4, 4, 4], minibatch_size=2, seed=3)  # ends in the epoch's last step
    saver.seek(2)
    state = saver.state_dict()
    assert state["trace_steps"] == [[4, 2]]
    longer = [4, 4, 2, 6, 4, 4, 2]
    resumed = TraceBatchSampler(10, longer, minibatch_size=2, seed=3)
    resumed.load_state_dict(state)
    straight = TraceBatchSampler(10, longer, minibatch_size=2, seed=3)
    straight.seek(2)
    assert list(resumed) == list(straight) and [s.batch_size for s in resumed.steps()] == [2]
    for epoch in (1,):
        resumed.set_epoch(epoch)
        straight.set_epoch(epoch)
        assert list(resumed) == list(straight)


@pytest.mark.parametrize(
    ("trace", "difference", "message"),
    [
        (
            [4, 8, 4],
            (1, 4, 8),
            "sampler state has taken 2 steps of another trace: its step 1 had batch size 4, and trace "
            "'<list>' has 8 there; resume with a trace whose first 2 steps are the ones taken (it may go on longer)",
        ),
        (
            [4],
            (1, 4, None),
            "sampler state has taken 2 steps of another trace: trace '<list>' has only 1 steps",
        ),
    ],
)
def test_a_trace_that_differs_in_the_steps_taken_is_refused_naming_the_step(
    trace: list[int], difference: tuple[int, int, int | None], message: str
) -> None:
    saver = TraceBatchSampler(10, [4, 4, 4], minibatch_size=2)
    saver.seek(2)
    with pytest.raises(TraceMismatch, match=re.escape(message)) as caught:
        TraceBatchSampler(10, trace, minibatch_size=2).load_state_dict(saver.state_dict())
    assert isinstance(caught.value, ValueError)  # (a bad argument: the library's rule)
    assert (caught.value.step, caught.value.saved, caught.value.here) == difference


def test_a_state_without_the_steps_taken_is_checked_against_the_whole_trace() -> None:
    saver = TraceBatchSampler(10, [4, 4, 4], minibatch_size=2)
    saver.seek(2)
    old = {k: v for k, v in saver.state_dict().items() if k != "trace_steps"}  # as torchfold 0.3 wrote it
    TraceBatchSampler(10, [4, 4, 4], minibatch_size=2).load_state_dict(old)
    with pytest.raises(
        ValueError, match="saved with trace_num_steps=3 but this sampler has trace_num_steps=4"
    ):
        TraceBatchSampler(10, [4, 4, 4, 4], minibatch_size=2).load_state_dict(old)
    for bad in ([[4, 1]], [[4, 2.0]], "4x2", [[4, 0], [4, 2]]):
        with pytest.raises(ValueError, match="'trace_steps' is not a list of"):
            TraceBatchSampler(10, [4, 4, 4], minibatch_size=2).load_state_dict(
                {**saver.state_dict(), "trace_steps": bad}
            )
