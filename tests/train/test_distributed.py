"""Multi-process training with gloo on localhost equals one process; dead or mismatched ranks fail fast.

Every check runs real processes (spawned) that talk over real sockets. To keep the spawn cost
down, one process group per world size runs all the LR rules (and DDP) one after the other.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dist_worker import (
    LR,
    REF_BATCH,
    agent_store_rank,
    free_port,
    handshake_rank,
    make_model,
    make_sampler,
    mnist_rows,
    run_ranks,
    train,
    train_rank,
)
from torch.nn.parallel import DistributedDataParallel

import torchfold._deprecation
from torchfold.train.data.sampler import minibatches_per_rank
from torchfold.train.distributed import world as distributed
from torchfold.train.optim.lr import scaled_lr
from torchfold.train.optim.optimizer import AccumulatingOptimizer

REPO = Path(__file__).resolve().parents[2]
MINIBATCH = 8
# Global batches of 8 leave two of three ranks (one of two) without a minibatch; 40 gives 2/2/1.
TRACE = [8, 24, 16, 40, 8, 32, 56, 16]
RULES = ["constant", "linear", "sqrt", "adascale"]
RUNS = [(rule, False) for rule in RULES] + [("linear", True), ("adascale", True)]


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor]:
    return mnist_rows(sum(TRACE))


def _reference(rule: str, data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, object]:
    """One process, plain PyTorch: one SGD step per trace step on the mean loss over the whole global batch.

    The LR factor of AdaScale depends on how the batch was split, so for it the reference is the
    wrapper in one process with the same minibatches (its gain is checked against a hand
    computation in test_optim.py).
    """
    model = make_model(seed=100)  # rank 0's initial values
    if rule == "adascale":
        return train(model, rule, data, TRACE, MINIBATCH, num_replicas=1, rank=0)
    x, y = data
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sampler = make_sampler(len(x), TRACE, MINIBATCH, 1, 0)
    batches = iter(sampler)
    for plan in sampler.steps():
        idx = [i for _ in range(plan.local_minibatches) for i in next(batches)]
        opt.param_groups[0]["lr"] = scaled_lr(LR, plan.batch_size, REF_BATCH, rule)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return {"params": [p.detach() for p in model.parameters()]}


def test_the_trace_has_ranks_without_minibatches() -> None:
    for world_size in (2, 3):
        counts = [minibatches_per_rank(b, MINIBATCH, world_size) for b in TRACE]
        assert any(0 in c for c in counts) and any(max(c) > 1 for c in counts)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_multi_process_training_equals_one_process(
    world_size: int, data: tuple[torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    port = free_port()
    # With three ranks, a second run then loses rank 2 at step 3: the others must fail, not hang.
    die = (2, 3, 0.0) if world_size == 3 else None
    args = [(world_size, port, data, TRACE, MINIBATCH, RUNS, die) for _ in range(world_size)]
    results = run_ranks(train_rank, args, tmp_path, timeout=90)
    survivors = results[:2] if die is not None else results
    for rank, result in enumerate(survivors):
        assert result is not None and "ok" in result, f"rank {rank}: {result}"
    outputs = [result["ok"] for result in survivors if result is not None]
    for name in outputs[0]:
        if name == "after_death":
            continue
        rule = name.removesuffix("-ddp")
        expected = _reference(rule, data)
        for rank, out in enumerate(outputs):
            assert out[name]["local_minibatches"] == [
                minibatches_per_rank(b, MINIBATCH, world_size)[rank] for b in TRACE
            ]
            for p, q in zip(out[name]["params"], expected["params"], strict=True):  # type: ignore[call-overload]
                torch.testing.assert_close(
                    p, q, msg=lambda m, name=name, rank=rank: f"{name}, rank {rank}: {m}"
                )
            if rule == "adascale":
                assert out[name]["factors"] == pytest.approx(expected["factors"], rel=1e-9)
                assert any(f > 1.0 for f in out[name]["factors"])
            else:
                assert out[name]["factors"] == pytest.approx(
                    [scaled_lr(1.0, b, REF_BATCH, rule) for b in TRACE]
                )
    if die is not None:
        assert results[2] is None  # the dead rank said nothing
        for rank in (0, 1):
            message, seconds = outputs[rank]["after_death"]
            assert f"failed on rank {rank} of 3 (gloo): another rank died" in message
            assert (
                "another rank died or did not reach the same all-reduce within the group's timeout of 5 s"
                in message
            )
            assert seconds < 10.0, f"rank {rank} took {seconds:.1f} s to notice"


@pytest.mark.slow
def test_a_stalled_rank_makes_the_others_fail_after_the_timeout(tmp_path: Path) -> None:
    # Rank 1 stops answering at step 3 (alive, sockets open) for 6 s; the group's timeout is 2 s.
    port = free_port()
    args = [(2, port, mnist_rows(sum(TRACE)), TRACE, MINIBATCH, [], (1, 3, 6.0), 2.0) for _ in range(2)]
    results = run_ranks(train_rank, args, tmp_path, timeout=60)
    assert results[1] is None
    assert results[0] is not None and "ok" in results[0], results[0]
    message, seconds = results[0]["ok"]["after_death"]
    assert "failed on rank 0 of 2 (gloo): another rank died or did not reach the same all-reduce" in message
    assert "within the group's timeout of 2 s" in message
    assert 1.5 <= seconds < 6.0, f"rank 0 gave up after {seconds:.1f} s"


@pytest.mark.slow
def test_mismatched_ranks_fail_with_a_clear_error_within_the_timeout(tmp_path: Path) -> None:
    same = {"trace": distributed.fingerprint(TRACE), "minibatch_size": MINIBATCH}
    scenarios = [
        {"world_size": [2, 2], "config": [same, {**same, "trace": distributed.fingerprint(TRACE[:-1])}]},
        {"world_size": [3, 2], "config": [same, same]},
        {"world_size": [2, 2], "config": [same, same], "absent": [1]},
        # rank 1 still reading when rank 0, which hosts the store, has decided: both report the mismatch
        {
            "world_size": [2, 2],
            "config": [same, {**same, "minibatch_size": MINIBATCH + 1}],
            "slow_reader": [1],
            "timeout": 6.0,
        },
    ]
    for scenario in scenarios:  # 6 s above: rank 1 arrives ~2 s before rank 0, still in the "absent" scenario
        scenario.setdefault("timeout", 2.0)
        scenario.update(port=free_port())
    outcomes = run_ranks(handshake_rank, [(scenarios,), (scenarios,)], tmp_path, timeout=60)
    assert all(o is not None and "ok" in o for o in outcomes), outcomes
    rank0, rank1 = (o["ok"] for o in outcomes if o is not None)
    trace0, trace1 = distributed.fingerprint(TRACE), distributed.fingerprint(TRACE[:-1])
    for rank, outcome in enumerate((rank0[0], rank1[0])):
        assert outcome.startswith("ValueError")
        assert (
            f"ranks disagree at startup (seen by rank {rank}): trace differs (rank 0: '{trace0}', rank 1: '{trace1}')"
            in outcome
        )
    # Rank 0 expects 3 ranks, rank 1 says 2: both see it as soon as both have joined (rank 0 no
    # longer waits for a rank 2 until its timeout).
    for rank, outcome in enumerate((rank0[1], rank1[1])):
        assert outcome.startswith("ValueError")
        assert f"(seen by rank {rank}): world_size differs (rank 0: 3, rank 1: 2)" in outcome
        assert float(outcome.split(" after ")[1].split(" s")[0]) < 2.0
    assert rank0[2].startswith("TimeoutError") and "waited 2 s for ranks [1] of world_size=2" in rank0[2]
    assert rank1[2] == "absent"
    seconds = float(rank0[2].split(" after ")[1].split(" s")[0])
    assert 2.0 <= seconds < 6.0
    for rank, outcome in enumerate((rank0[3], rank1[3])):
        assert outcome.startswith("ValueError"), outcome
        assert (
            f"(seen by rank {rank}): minibatch_size differs (rank 0: {MINIBATCH}, rank 1: {MINIBATCH + 1})"
            in outcome
        )


@pytest.mark.slow
def test_mismatched_world_sizes_fail_clearly_on_every_rank_every_time(tmp_path: Path) -> None:
    """Rank 0 with world size 2, rank 1 with 3, launched 8 times: both ranks name the mismatch at once.

    Rank 1 used to wait for a rank 2 until its timeout while rank 0, the store's host, waited for
    rank 1 to finish reading for the same time: whoever's clock ran out first decided, and rank 1
    often died on the closed store with a C++ stack trace ending in 'Broken pipe'. Starts are
    staggered both ways, and a third of the launches give rank 1 slow store reads.
    """
    same = {"trace": distributed.fingerprint(TRACE)}
    for launch in range(8):
        scenario = {
            "world_size": [2, 3],
            "config": [same, same],
            "timeout": 2.0,
            "port": free_port(),
            "delay": {launch % 2: 0.05 * (launch % 4)},
            "slow_reader": [1] if launch % 3 == 0 else [],
        }
        outcomes = run_ranks(handshake_rank, [([scenario],), ([scenario],)], tmp_path, timeout=30)
        messages = []
        for rank, outcome in enumerate(outcomes):
            assert outcome is not None and "ok" in outcome, f"launch {launch}, rank {rank}: {outcome}"
            messages += outcome["ok"]
        for rank, message in enumerate(messages):
            assert message.startswith("ValueError after "), f"launch {launch}, rank {rank}: {message}"
            assert (
                f"ranks disagree at startup (seen by rank {rank}): world_size differs (rank 0: 2, rank 1: 3)"
                in message
            )
        for rank, message in enumerate(messages):
            seconds = float(message.split(" after ")[1].split(" s")[0])
            assert seconds < 2.0, f"launch {launch}, rank {rank} waited for its timeout: {message}"


@pytest.mark.slow
def test_each_group_on_torchruns_agent_store_has_keys_of_its_own(tmp_path: Path) -> None:
    """Two groups one after the other on one agent's store, with the same restart count.

    torchrun's agent hosts one store for every group it starts, and a node that joins a running
    job (``--nnodes=MIN:MAX``) makes it start a larger group without counting a restart. The
    second group must not read the first one's handshake entries or gloo addresses (whose
    processes are gone): each forms at once with its own world size.
    """
    agent_store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for group, world_size in enumerate((2, 3)):
        folder = tmp_path / f"group{group}"
        folder.mkdir()
        results = run_ranks(
            agent_store_rank, [(world_size, agent_store.port, 0)] * world_size, folder, timeout=60
        )
        for rank, result in enumerate(results):
            assert result == {"ok": float(world_size)}, f"group {group}, rank {rank}: {result}"


_GLOO_THREADS_AFTER_DESTROY = """
import os, sys
import torch
import torch.distributed as dist
from torchfold.train.distributed.world import init_distributed

init_distributed("gloo", rank=0, world_size=1, master_port=int(sys.argv[1]), timeout=10.0)
model = torch.nn.Linear(2, 2)
torch.optim.Adam(model.parameters())  # the first optimizer imports torch.distributed.nn.functional
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
print(sorted(name for name in names if "gloo" in name))
print("torch.distributed.nn.functional" in sys.modules)
"""


@pytest.mark.slow
def test_destroy_process_group_stops_the_gloo_threads_after_an_optimizer_was_made() -> None:
    """No gloo thread outlives ``destroy_process_group()``, so none runs into the interpreter's shutdown.

    ``torch.distributed.nn.functional``, imported by the first optimizer, makes the group its
    functions' default argument; imported after the group existed, it kept the group, and gloo's
    worker threads, alive until the interpreter shut down. A worker freeing the tensors of the last
    collective then aborted the process (SIGABRT) after a successful run, now and then, on a busy
    machine: a restarted torchrun group with no restarts left failed that way.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _GLOO_THREADS_AFTER_DESTROY, str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True"], done.stdout + done.stderr


def _train_cli_ranks(per_rank: list[tuple[int, list[str]]]) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python -m torchfold train`` once per ``(WORLD_SIZE, extra arguments)``, as ranks 0, 1, ..."""
    port = free_port()
    base = ["--trace", "12", "--minibatch-size", "6", "--max-train", "24", "--generate", "24"]
    base += [
        "--embedding-dim",
        "4",
        "--hidden-dim",
        "4",
        "--max-steps",
        "1",
        "--no-progress",
        "--timeout",
        "10",
    ]
    procs = []
    for rank, (world_size, extra) in enumerate(per_rank):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            **{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)},
            **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
        }
        command = [sys.executable, "-m", "torchfold", "train", *base, *extra]
        procs.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.slow
@pytest.mark.parametrize(
    ("per_rank", "message"),
    [
        ([(2, []), (3, [])], "world_size differs (rank 0: 2, rank 1: 3)"),
        ([(2, ["--lr", "0.01"]), (2, ["--lr", "0.02"])], "--lr differs (rank 0: 0.01, rank 1: 0.02)"),
    ],
)
def test_train_cli_ranks_that_disagree_exit_with_one_line_naming_the_setting(
    per_rank: list[tuple[int, list[str]]], message: str
) -> None:
    for rank, done in enumerate(_train_cli_ranks(per_rank)):
        assert done.returncode == 2, f"rank {rank}: {done.stderr}"
        assert done.stderr.startswith(
            f"torchfold train: error: torchfold: ranks disagree at startup (seen by rank {rank}): {message}"
        ), f"rank {rank}: {done.stderr}"
        assert done.stderr.count("\n") == 1, f"rank {rank}: {done.stderr}"


class _ClosedStore:
    """A store client whose host (rank 0) has gone by the time this rank touches one of ``gone_at``
    (key suffixes): from then on every call fails like a real TCPStore's."""

    def __init__(self, entries: dict[str, str], gone_at: tuple[str, ...]) -> None:
        self.entries, self.gone_at, self.gone = entries, gone_at, False

    def _call(self, key: str) -> None:
        self.gone = self.gone or key.endswith(self.gone_at)
        if self.gone:
            raise torch.distributed.DistNetworkError("Broken pipe\nException raised from sendBytes at ...")

    def add(self, key: str, amount: int) -> int:
        self._call(key)
        return 0

    def set(self, key: str, value: str) -> None:
        self._call(key)
        self.entries[key] = value

    def check(self, keys: list[str]) -> bool:
        self._call(keys[0])
        return all(k in self.entries for k in keys)

    def get(self, key: str) -> bytes:
        self._call(key)
        return self.entries[key].encode()


def test_a_rank_that_loses_the_store_says_so_in_one_line_and_keeps_its_own_error() -> None:
    from torchfold.train.distributed.world import _handshake

    # Rank 0 left while rank 1 was still waiting for it: one clear line, not a C++ trace.
    with pytest.raises(RuntimeError) as info:
        _handshake(_ClosedStore({}, gone_at=("/0",)), 1, 2, {}, timeout_s=5.0)  # type: ignore[arg-type]
    assert str(info.value) == (
        "torchfold: rank 1 lost the rendezvous store during the startup handshake: rank 0, which hosts it, "
        "stopped first; its own error says why (Broken pipe)"
    )
    # Rank 1 found the mismatch, but rank 0 was gone before rank 1 could mark itself finished:
    # its own error stands (it used to be replaced by the Broken pipe of that last call).
    rank0 = {"torchfold/handshake/0": '{"world_size": 2, "seed": 1}'}
    store = _ClosedStore(rank0, gone_at=("/left", "/done/1"))
    with pytest.raises(ValueError, match=r"seed differs \(rank 0: 1, rank 1: 2\)"):
        _handshake(store, 1, 2, {"seed": 2}, timeout_s=5.0)  # type: ignore[arg-type]
    assert store.gone


def test_single_process_helpers() -> None:
    assert (distributed.world(), distributed.is_main_process()) == ((1, 0, "single process"), True)
    assert distributed.default_device() == torch.device("cpu")
    t = torch.arange(3.0)
    distributed.all_reduce_sum_([t])
    torch.testing.assert_close(t, torch.arange(3.0))
    distributed.broadcast_parameters(make_model())
    distributed.check_same_on_all_ranks({"a": 1})
    assert distributed.fingerprint({"b": [1, 2], "a": 1}) == distributed.fingerprint({"a": 1, "b": [1, 2]})


def test_get_world_size_and_get_rank_are_deprecated_aliases_of_world() -> None:
    import torchfold.train as tt

    for old in ("get_world_size()", "get_rank()"):  # each warns once per process
        torchfold._deprecation._warned.discard(f"torchfold.train.{old}")
    with pytest.warns(
        FutureWarning, match=r"get_world_size\(\) is deprecated; use torchfold.train.world\(\).size"
    ):
        assert tt.get_world_size() == 1
    with pytest.warns(FutureWarning, match=r"use torchfold.train.world\(\).rank"):
        assert tt.get_rank() == 0
    assert "get_world_size" not in tt.__all__ and "world" in tt.__all__


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"rank": 2, "world_size": 2},
            ValueError,
            r"Invalid rank 2, rank should be in the interval \[0, 1\]",
        ),
        ({"rank": 0, "world_size": 0}, ValueError, "world_size must be a positive int, got 0"),
        ({"rank": True, "world_size": 2}, TypeError, "rank must be an int, got bool"),
        (
            {"rank": 0, "world_size": 1, "timeout": 0.0},
            ValueError,
            "timeout must be a positive number of seconds",
        ),
    ],
)
def test_init_distributed_checks_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        distributed.init_distributed("gloo", master_port=free_port(), **kwargs)


def test_init_distributed_needs_rank_from_somewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="rank was not given and the environment variable RANK is not set"):
        distributed.init_distributed("gloo", world_size=1, master_port=free_port())


def test_ddp_module_stays_in_no_sync_until_close() -> None:
    # A real one-process gloo group, so that DistributedDataParallel can wrap the model.
    distributed.init_distributed("gloo", rank=0, world_size=1, master_port=free_port(), timeout=5.0)
    try:
        ddp = DistributedDataParallel(make_model())
        opt = AccumulatingOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR), module=ddp)
        assert not ddp.require_backward_grad_sync
        x, y = mnist_rows()
        opt.backward(F.cross_entropy(ddp(x[:8]), y[:8]), num_samples=8)
        opt.step()
        opt.zero_grad()
        opt.close()
        assert ddp.require_backward_grad_sync
        with pytest.raises(RuntimeError, match="no longer in no_sync"):
            opt.backward(F.cross_entropy(ddp(x[:8]), y[:8]), num_samples=8)
        with_buffers = DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        )
        with pytest.raises(ValueError, match="broadcast_buffers=False"):
            AccumulatingOptimizer(torch.optim.SGD(with_buffers.parameters(), lr=LR), module=with_buffers)
        # Newer PyTorch renamed the flag; the old name still works there, with a warning.
        names = inspect.signature(DistributedDataParallel).parameters
        flag = "forward_sync_buffers" if "forward_sync_buffers" in names else "broadcast_buffers"
        no_broadcast = DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), **{flag: False}
        )
        AccumulatingOptimizer(torch.optim.SGD(no_broadcast.parameters(), lr=LR), module=no_broadcast).close()
    finally:
        torch.distributed.destroy_process_group()
