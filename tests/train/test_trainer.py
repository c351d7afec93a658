"""The trace-aware training loop equals one big batch per step, in one process and over gloo ranks.

Real SST trees, a small float64 Tree-LSTM, real processes: spawned ranks talking over localhost,
a rank killed with SIGKILL and the run resumed from its checkpoint, and a run under ``torchrun``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import math
import os
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist_worker import free_port, run_ranks
from _loop_worker import (
    LR,
    MINIBATCH,
    NUM_TREES,
    REF_BATCH,
    TRACE,
    make_model,
    make_trainer,
    params_of,
    sst_trees,
    train_rank,
)
from _train_cli import train, write_sst

from torchfold.engine.fold import Fold
from torchfold.examples.datasets import Tree, Vocab
from torchfold.examples.models import TreeLSTMBuild, encode_trees, tree_lstm_loss
from torchfold.train.data.loader import StepLoader
from torchfold.train.data.sampler import minibatches_per_rank
from torchfold.train.loop.checkpoint import list_checkpoints, load_checkpoint
from torchfold.train.loop.trainer import DEFAULT_LOG_EVERY, StepStats, TraceTrainer
from torchfold.train.optim.lr import scaled_lr
from torchfold.train.optim.optimizer import AccumulatingOptimizer

# The global batches of TRACE over 120 trees, worked out by hand: each epoch's last step is cut to
# the trees left (drop_last=False), and epoch 1 starts at the trace step after epoch 0's last.
EPOCH_SIZES = [[12, 6, 18, 30, 6, 24, 12, 12], [36, 6, 30, 24, 18, 6]]
SAMPLER_SEED = 3
REPO = Path(__file__).resolve().parents[2]


def _tree_loss(model: torch.nn.Module, trees: list[Tree], vocab: Vocab) -> torch.Tensor:
    """Mean over trees of the mean cross-entropy over each tree's nodes, one fold for all trees."""
    fold = Fold()
    nodes, labels, roots = encode_trees(fold, trees, vocab)
    [states] = fold.apply(model, [nodes])
    losses = F.cross_entropy(model.logits(states), torch.tensor(labels), reduction="none")  # type: ignore[operator]
    starts = [0, *(r + 1 for r in roots[:-1])]
    return torch.stack([losses[a : b + 1].mean() for a, b in zip(starts, roots, strict=True)]).mean()


@functools.cache
def _reference(lr_rule: str, max_norm: float | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch: each step's whole global batch as one batch, Adam with the rule's LR set by hand
    (its gradient clipped by ``clip_grad_norm_`` to ``max_norm``, where given).

    The global batches come from the epoch's permutation (``seed + epoch``) cut at EPOCH_SIZES.
    """
    trees = sst_trees()
    vocab = Vocab.build(trees)
    model = make_model(vocab, seed=100)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for epoch, sizes in enumerate(EPOCH_SIZES):
        order = torch.randperm(len(trees), generator=torch.Generator().manual_seed(SAMPLER_SEED + epoch))
        start = 0
        for size in sizes:
            batch = [trees[i] for i in order[start : start + size].tolist()]
            start += size
            for group in opt.param_groups:
                group["lr"] = scaled_lr(LR, size, REF_BATCH, lr_rule)
            opt.zero_grad()
            loss = _tree_loss(model, batch, vocab)
            loss.backward()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            losses.append(loss.item())
    return params_of(model), losses


@functools.cache
def _loop_run(lr_rule: str) -> tuple[TraceTrainer, list[StepStats]]:
    """The loop in this process (rank 0's initial values), over the whole trace."""
    trainer = make_trainer(sst_trees(), lr_rule=lr_rule, seed=100)
    return trainer, trainer.fit()


@pytest.fixture(scope="module")
def trees() -> list[Tree]:
    return sst_trees()


def test_the_trace_gives_idle_ranks_and_accumulation() -> None:
    sizes = [b for epoch in EPOCH_SIZES for b in epoch]
    for world_size in (2, 3):
        counts = [minibatches_per_rank(b, MINIBATCH, world_size) for b in sizes]
        assert any(0 in c for c in counts) and any(max(c) > 1 for c in counts)


@pytest.mark.parametrize("lr_rule", ["constant", "linear", "sqrt"])
def test_one_process_equals_one_big_batch_per_step(trees: list[Tree], lr_rule: str) -> None:
    expected, losses = _reference(lr_rule)
    trainer, history = _loop_run(lr_rule)
    assert [s.batch_size for s in history] == [b for epoch in EPOCH_SIZES for b in epoch]
    assert [s.epoch for s in history] == [0] * 8 + [1] * 6
    assert [s.step for s in history] == list(range(14))
    assert [s.num_minibatches for s in history] == [-(-s.batch_size // MINIBATCH) for s in history]
    assert [s.lr for s in history] == pytest.approx(
        [scaled_lr(LR, s.batch_size, REF_BATCH, lr_rule) for s in history]
    )
    assert [s.loss for s in history] == pytest.approx(losses, rel=1e-9)
    assert all(s.local_nodes > s.batch_size for s in history)  # every node of every tree was folded
    torch.testing.assert_close(params_of(trainer.model), expected)
    assert trainer.next_step == 14
    assert trainer.fit() == []  # the trace's complete epochs are done


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_equal_one_process_taking_the_same_global_batches(
    trees: list[Tree], world_size: int, tmp_path: Path
) -> None:
    runs = [{"name": "linear"}]  # each LR rule over ranks: test_distributed.py
    results = run_ranks(train_rank, [(world_size, free_port(), runs)] * world_size, tmp_path, timeout=90)
    for rank, result in enumerate(results):
        assert result is not None and "ok" in result, f"rank {rank}: {result}"
    for run in runs:
        expected, losses = _reference(run.get("lr_rule", "linear"))
        for rank, result in enumerate(results):
            out = result["ok"][run["name"]]  # type: ignore[index]
            history: list[StepStats] = out["history"]
            assert [s.local_minibatches for s in history] == [
                minibatches_per_rank(s.batch_size, MINIBATCH, world_size)[rank] for s in history
            ]
            assert [s.loss for s in history] == pytest.approx(losses, rel=1e-9)  # all-reduced, on every rank
            torch.testing.assert_close(out["params"], expected, msg=lambda m, r=rank: f"rank {r}: {m}")
        idle = [s for s in results[-1]["ok"][run["name"]]["history"] if s.local_minibatches == 0]  # type: ignore[index]
        assert idle and all(s.local_nodes == 0 for s in idle)


@pytest.mark.slow
def test_a_killed_rank_fails_the_others_and_the_run_resumes_exactly(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    killed = {"name": "killed", "dropout": True, "checkpoint_dir": str(ckpt), "checkpoint_every": 3}
    results = run_ranks(
        train_rank, [(2, free_port(), [{**killed, "die_after": (1, 6)}])] * 2, tmp_path / "a", timeout=90
    )
    assert results[1] is None  # SIGKILLed: no word from it
    assert results[0] is not None and "ok" in results[0], results[0]
    failure = results[0]["ok"]["killed"]
    assert "failed on rank 0 of 2 (gloo): another rank died" in failure["error"]
    assert failure["seconds"] < 15.0
    assert [step for step, _ in list_checkpoints(ckpt)] == [3, 6]  # keep_checkpoints=2; step 9 never came
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # no temporary files left behind

    resumed = {**killed, "name": "resumed", "resume": True}
    uninterrupted = {"name": "uninterrupted", "dropout": True}
    results = run_ranks(
        train_rank, [(2, free_port(), [resumed, uninterrupted])] * 2, tmp_path / "b", timeout=90
    )
    for rank, result in enumerate(results):
        assert result is not None and "ok" in result, f"rank {rank}: {result}"
        out = result["ok"]
        assert out["resumed"]["resumed"] == "step-00000006.pt"
        assert [s.step for s in out["resumed"]["history"]] == list(range(6, 14))
        # Dropout and Python's random are used every minibatch: equal only if every generator resumed.
        for name, p in out["uninterrupted"]["params"].items():
            assert torch.equal(out["resumed"]["params"][name], p), f"rank {rank}: {name} differs"
        assert [s.loss for s in out["resumed"]["history"]] == [
            s.loss for s in out["uninterrupted"]["history"][6:]
        ]


def test_resume_in_one_process_is_exact_and_checkpoints_load_weights_only(
    trees: list[Tree], tmp_path: Path
) -> None:
    whole = make_trainer(trees, dropout=True)
    whole.fit()
    # Worker processes build ahead: the checkpoint still holds the position of the last step trained.
    first = make_trainer(trees, dropout=True, checkpoint_dir=str(tmp_path), checkpoint_every=4, num_workers=1)
    assert [s.step for s in first.fit(max_steps=10)] == list(range(10))
    first.loader.close()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [8, 10]  # every 4 steps, and where fit stopped
    state = load_checkpoint(tmp_path / "step-00000010.pt")  # weights_only=True inside
    assert state["step"] == 10 and state["loader"]["sampler"]["next_step"] == 10 and state["world_size"] == 1
    second = make_trainer(trees, dropout=True, checkpoint_dir=str(tmp_path), seed=5, num_workers=1)
    assert second.resume() == tmp_path / "step-00000010.pt"
    assert [s.step for s in second.fit()] == [10, 11, 12, 13]
    second.loader.close()
    for name, p in params_of(whole.model).items():
        assert torch.equal(params_of(second.model)[name], p), name


def test_fit_continues_where_the_last_fit_stopped(trees: list[Tree]) -> None:
    whole, _ = _loop_run("linear")
    parts = make_trainer(trees, seed=100)
    steps = [s.step for n in (3, 8, 11, 14) for s in parts.fit(max_steps=n)]  # 8: an epoch boundary
    assert steps == list(range(14))
    torch.testing.assert_close(params_of(parts.model), params_of(whole.model), rtol=0, atol=0)


def test_steps_reported_one_late_are_recorded_once_and_on_step_sees_its_own_step(
    trees: list[Tree], tmp_path: Path
) -> None:
    """In one process on an accelerator, fit() reads a step's loss after launching the next step.
    (Forced here on the CPU, where the loop is the same: the test suite has no accelerator.) The
    run equals the undeferred one; a failing on_step is recorded once; with an on_step, a step is
    reported before the next one is launched, so a save_checkpoint() from on_step holds the model
    of the step it reports (it was refused when the next step had run already)."""
    whole, expected = _loop_run("linear")
    deferred = make_trainer(trees, seed=100)
    deferred._defers = True
    history = deferred.fit()
    assert [(s.step, s.loss) for s in history] == [(s.step, s.loss) for s in expected]
    torch.testing.assert_close(params_of(deferred.model), params_of(whole.model), rtol=0, atol=0)

    seen: list[int] = []

    def failing(stats: StepStats) -> None:
        seen.append(stats.step)
        if stats.step == 2:
            raise KeyError("on_step failed")

    trainer = make_trainer(trees, seed=100, on_step=failing)
    trainer._defers = True
    with pytest.raises(KeyError, match="on_step failed"):
        trainer.fit()
    assert seen == [0, 1, 2]  # step 2 reported once, not again while the run unwinds

    def saving(stats: StepStats) -> None:
        if stats.step == 0:
            trainer.save_checkpoint(tmp_path / "step0.pt")

    trainer = make_trainer(trees, seed=100, on_step=saving)
    trainer._defers = True
    trainer.fit()
    one_step = make_trainer(trees, seed=100)
    one_step.fit(max_steps=1)
    saved = load_checkpoint(tmp_path / "step0.pt")
    assert saved["step"] == 1
    for name, value in one_step.model.state_dict().items():
        torch.testing.assert_close(saved["model"][name], value, rtol=0, atol=0)


def test_the_users_optimizer_keeps_its_minibatch_size_and_the_run_weighs_by_the_loaders(
    trees: list[Tree],
) -> None:
    """The trainer weighs each minibatch by its loader's batch_size where the optimizer has no
    minibatch_size (full minibatches then need no weighting pass), without writing it into the
    user's optimizer; the run equals one whose optimizer was given that minibatch_size."""
    trainer = make_trainer(trees, seed=100)
    assert trainer.optimizer.minibatch_size is None and trainer.minibatch_size == MINIBATCH
    units: list[float] = []

    def loss(model: torch.nn.Module, outputs: list[torch.Tensor], targets: Any) -> torch.Tensor:
        units.append(trainer.optimizer.minibatch_unit())  # inside the step: what gradients are weighted by
        return tree_lstm_loss(model, outputs, targets)

    trainer.loss = loss
    history = trainer.fit()
    assert trainer.optimizer.minibatch_size is None and trainer.optimizer.minibatch_unit() == 1.0
    assert units and set(units) == {float(MINIBATCH)}
    given = make_trainer(trees, seed=100)
    given.optimizer.minibatch_size = MINIBATCH  # the user's own setting, as the trainer once wrote it
    expected = given.fit()
    assert [(s.step, s.loss) for s in history] == [(s.step, s.loss) for s in expected]
    torch.testing.assert_close(params_of(trainer.model), params_of(given.model), rtol=0, atol=0)


def test_log_lines_and_progress_are_on_the_main_rank(trees: list[Tree]) -> None:
    lines: list[str] = []
    vocab = Vocab.build(trees)
    model = make_model(vocab)
    opt = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), lr_rule="linear", ref_batch_size=6
    )
    loader = StepLoader(trees, MINIBATCH, build=TreeLSTMBuild(vocab), trace=12)
    trainer = TraceTrainer(model, opt, loader, tree_lstm_loss, log_every=2, log=lines.append)
    assert trainer.progress is False  # stderr is not a terminal under pytest
    history = trainer.fit(max_steps=4)
    assert len(history) == 4 and len(lines) == 2
    assert lines[0].startswith("step 2/4 | epoch 0 | batch 12 (2 minibatches) | lr 0.2 | loss ")
    loss = (history[0].loss + history[1].loss) / 2
    assert f"| loss {loss:.4f} (mean over the last 2 steps) | " in lines[0] and lines[0].endswith(
        " samples/s"
    )


def test_off_a_terminal_the_default_is_log_lines_every_50_steps_and_at_the_end(trees: list[Tree]) -> None:
    vocab = Vocab.build(trees)

    def trainer(**options: Any) -> tuple[TraceTrainer, list[str]]:
        lines: list[str] = []
        model = make_model(vocab)
        opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        loader = StepLoader(trees, MINIBATCH, build=TreeLSTMBuild(vocab), trace=6)
        return TraceTrainer(model, opt, loader, tree_lstm_loss, log=lines.append, **options), lines

    quiet, lines = trainer()  # stderr is not a terminal under pytest: no bar, so log lines
    assert quiet.progress is False and quiet.log_every == DEFAULT_LOG_EVERY == 50
    quiet.fit(max_steps=53)
    assert [line.split(" | ")[0] for line in lines] == ["step 50/53", "step 53/53"]
    barred, lines = trainer(progress=True)  # a bar: its postfix shows the loss, no lines beside it
    assert barred.log_every == 0
    barred.fit(max_steps=2)
    assert lines == []
    quiet, lines = trainer(progress=False)  # asked for no progress: no lines either
    assert quiet.log_every == 0
    quiet.fit(max_steps=2)
    assert lines == []
    logged, lines = trainer(progress=False, log_every=2)
    logged.fit(max_steps=3)
    assert [line.split(" | ")[0] for line in lines] == ["step 2/3", "step 3/3"]


def test_on_a_terminal_the_default_is_a_bar_without_log_lines() -> None:
    script = (
        "import torch\n"
        "from torchfold.examples.datasets import Vocab, generate_sst\n"
        "from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss\n"
        "from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer\n"
        "trees = generate_sst(8, seed=0); vocab = Vocab.build(trees); model = TreeLSTM(len(vocab), 4, 4)\n"
        "opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "t = TraceTrainer(model, opt, StepLoader(trees, 4, build=TreeLSTMBuild(vocab), trace=4), tree_lstm_loss)\n"
        "print('settings', t.progress, t.log_every, flush=True)\n"
        "t.fit(max_steps=2)\n"
    )
    main, child = os.openpty()  # stderr is a terminal, stdout a pipe
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns wide
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=child, text=True, timeout=120
        )
        os.close(child)
        child = -1
        shown = b""
        with contextlib.suppress(OSError):  # EIO once the terminal's last writer is gone
            while chunk := os.read(main, 4096):
                shown += chunk
    finally:
        os.close(main)
        if child >= 0:
            os.close(child)
    assert done.returncode == 0, shown.decode(errors="replace")[-2000:]
    assert done.stdout.splitlines() == ["settings True 0"]  # a bar, no log lines
    assert b"2/2" in shown and b"step" in shown  # tqdm's bar, drawn on the terminal


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_stops_the_run_naming_the_step_and_the_last_checkpoint(
    trees: list[Tree], tmp_path: Path, bad: float
) -> None:
    vocab = Vocab.build(trees)
    model = make_model(vocab)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []

    def loss_fn(model: torch.nn.Module, outputs: list[torch.Tensor], targets: Any) -> torch.Tensor:
        calls.append(1)  # two minibatches per step: the 9th call is in step 4
        loss = tree_lstm_loss(model, outputs, targets)
        return loss * bad if len(calls) == 9 else loss

    loader = StepLoader(trees, MINIBATCH, build=TreeLSTMBuild(vocab), trace=12)
    trainer = TraceTrainer(model, opt, loader, loss_fn, checkpoint_dir=tmp_path, checkpoint_every=3)
    with pytest.raises(FloatingPointError) as info:
        trainer.fit(max_steps=8)
    last = tmp_path / "step-00000003.pt"
    assert str(info.value) == (
        f"step 4: the loss became {bad}, so training stopped before saving this step; the last checkpoint "
        f"written is {last}: resume from it (or an earlier one) with a lower learning rate"
    )
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step-00000003.pt"]  # nothing after it
    fresh = TraceTrainer(
        make_model(vocab), opt, StepLoader(trees, MINIBATCH, build=TreeLSTMBuild(vocab), trace=12), loss_fn
    )
    calls.clear()
    with pytest.raises(
        FloatingPointError, match=r"^step 4: the loss became .*; no checkpoint was written before it$"
    ):
        fresh.fit(max_steps=8)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"optimizer": "sgd"}, TypeError, "optimizer must be a torchfold AccumulatingOptimizer"),
        ({"loader": 3}, TypeError, "loader must be a torchfold StepLoader, got int"),
        ({"build": None}, ValueError, "the loader has no build function: give it build="),
        ({"loss": "nll"}, TypeError, r"loss must be callable as loss\(model, outputs, targets\)"),
        (
            {"loader_rank": (1, 2)},
            ValueError,
            "the loader is for rank 1 of 2 but this process is rank 0 of 1",
        ),
        ({"checkpoint_every": -1}, ValueError, "checkpoint_every must be an int >= 0, got -1"),
        ({"keep_checkpoints": 0}, ValueError, "keep_checkpoints must be a positive int, got 0"),
        ({"checkpoint_every": 1.5}, TypeError, "checkpoint_every must be an int, got float 1.5"),
        ({"log_every": "10"}, TypeError, "log_every must be None or an int, got str '10'"),
        ({"seed": 2.0}, TypeError, "seed must be None or an int, got float 2.0"),
        ({"seed": -1}, ValueError, "seed must be None or an int >= 0, got -1"),
    ],
)
def test_bad_arguments(trees: list[Tree], change: dict, error: type[Exception], match: str) -> None:
    vocab = Vocab.build(trees)
    model = make_model(vocab)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, replicas = change.pop("loader_rank", (0, 1))
    build = change.pop("build", TreeLSTMBuild(vocab))
    args: dict = {
        "model": model,
        "optimizer": sgd if change.pop("optimizer", None) else AccumulatingOptimizer(sgd),
        "loader": StepLoader(trees, MINIBATCH, build=build, trace=12, num_replicas=replicas, rank=rank),
        "loss": tree_lstm_loss,
    }
    args.update(change)
    with pytest.raises(error, match=match):
        TraceTrainer(**args)


def test_unbounded_trace_needs_an_end_and_loss_must_be_a_scalar(trees: list[Tree]) -> None:
    vocab = Vocab.build(trees)
    model = make_model(vocab)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = StepLoader(trees, MINIBATCH, build=TreeLSTMBuild(vocab), trace=12)
    trainer = TraceTrainer(model, opt, loader, tree_lstm_loss)
    with pytest.raises(ValueError, match=r"have no end .*: pass max_steps= or epochs= to fit"):
        trainer.fit()
    with pytest.raises(TypeError, match=r"max_steps must be None or an int, got float 2\.0"):
        trainer.fit(max_steps=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="epochs must be None or an int >= 0, got -1"):
        trainer.fit(epochs=-1)
    assert len(trainer.fit(epochs=1)) == NUM_TREES // 12

    def per_node(model: torch.nn.Module, outputs: list[torch.Tensor], targets: tuple) -> torch.Tensor:
        return F.cross_entropy(model.logits(outputs[0]), torch.as_tensor(targets[0]), reduction="none")  # type: ignore[operator]

    poptorch_style = StepLoader(trees, MINIBATCH, build=TreeLSTMBuild(vocab), gradient_accumulation=2)
    bad = TraceTrainer(model, opt, poptorch_style, per_node)
    with pytest.raises(
        TypeError, match=r"loss must return a scalar tensor \(the minibatch's loss\), got Tensor\("
    ):
        bad.fit(max_steps=1)
    opt.zero_grad()
    good = TraceTrainer(model, opt, poptorch_style, tree_lstm_loss)
    history = good.fit(max_steps=3)  # the loader handed step 0 to the failed fit: it goes on from step 1
    assert [(s.step, s.batch_size, s.num_minibatches) for s in history] == [(1, 12, 2), (2, 12, 2)]


def _cli_args(trace: Path, data: Path, ckpt: Path) -> list[str]:
    return [
        "train",
        *("--trace", str(trace), "--data", str(data), "--minibatch-size", str(MINIBATCH)),
        *("--lr-rule", "linear", "--ref-batch-size", str(REF_BATCH), "--lr", str(LR)),
        *("--embedding-dim", "8", "--hidden-dim", "12", "--dtype", "float64", "--seed", "100"),
        *("--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--log-every", "5"),
        *("--no-progress", "--timeout", "20"),
    ]


@pytest.mark.slow
def test_torchrun_two_processes_equal_one_process(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("step,batchsize\n" + "".join(f"{i}, {b}\n" for i, b in enumerate(TRACE)))
    data = write_sst(tmp_path)
    args = _cli_args(trace, data, tmp_path / "one")
    assert train(args[1:]) == 0
    args = _cli_args(trace, data, tmp_path / "two")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "torchfold",
        *args,
    ]
    start = time.monotonic()
    done = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 process(es)" in done.stdout and "done: 14 steps" in done.stdout, done.stdout
    assert done.stdout.count("| lr ") == 3  # steps 5, 10 and the last (14), logged once (rank 0 only)
    assert time.monotonic() - start < 120
    one = load_checkpoint(tmp_path / "one" / "step-00000014.pt")
    two = load_checkpoint(tmp_path / "two" / "step-00000014.pt")
    assert two["world_size"] == 2 and len(two["rng"]) == 2
    torch.testing.assert_close(two["model"], one["model"])


def test_step_stats_num_replicas_and_its_deprecated_world_size_alias() -> None:
    stats = StepStats(
        step=0,
        epoch=0,
        batch_size=8,
        num_minibatches=2,
        local_minibatches=1,
        local_nodes=5,
        lr=0.1,
        loss=1.0,
        seconds=0.5,
        num_replicas=2,
    )
    assert stats.num_replicas == 2
    with pytest.warns(FutureWarning, match=r"StepStats.world_size is deprecated; use StepStats.num_replicas"):
        assert stats.world_size == 2


def test_max_grad_norm_clips_each_steps_mean_gradient_as_one_big_batch_clipped(trees: list[Tree]) -> None:
    """max_grad_norm= clips the step's gradient after the accumulation (the mean over the global
    batch), before the update: the run equals clip_grad_norm_ on one big batch per step."""
    params, losses = _reference("linear", max_norm=0.05)
    trainer = make_trainer(trees, seed=100, max_grad_norm=0.05)
    assert trainer.optimizer.max_grad_norm == 0.05
    history = trainer.fit()
    torch.testing.assert_close([s.loss for s in history], losses)
    torch.testing.assert_close(params_of(trainer.model), params)
    unclipped, _ = _reference("linear")
    assert any(not torch.allclose(params[name], unclipped[name]) for name in params)  # it clipped


def test_a_checkpoint_dir_with_a_run_in_it_is_resumed_and_resume_false_sets_it_aside(
    trees: list[Tree], tmp_path: Path
) -> None:
    """A second trainer on the same directory continues the first run (never overwriting its
    checkpoints from step 0); a different hyperparameter or setting is refused naming it;
    resume=False moves the old checkpoints to earlier-1 and starts at step 0."""
    lines: list[str] = []
    first = make_trainer(trees, seed=100, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    first.fit(max_steps=4)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 4]
    second = make_trainer(trees, seed=100, checkpoint_dir=str(tmp_path), log=lines.append)
    assert second.next_step == 4 and second.resumed_from == tmp_path / "step-00000004.pt"
    assert lines == [f"resumed from {tmp_path / 'step-00000004.pt'} at step 4"]
    assert [s.step for s in second.fit(max_steps=6)] == [4, 5]
    with pytest.raises(ValueError, match=r"step-00000006.pt was written with lr 0.01, this run has lr 0.02"):
        make_trainer(trees, seed=100, checkpoint_dir=str(tmp_path), lr=0.02)
    lines.clear()
    kept = make_trainer(
        trees,
        seed=100,
        checkpoint_dir=str(tmp_path),
        lr=0.02,
        override_hyperparameters=["lr"],
        log=lines.append,
    )
    assert kept.next_step == 6 and kept.optimizer.param_groups[0]["lr"] == 0.02
    assert lines[0].endswith("at step 6; lr 0.02 kept instead of the checkpoint's 0.01")
    other = tmp_path / "other"
    make_trainer(trees, checkpoint_dir=str(other), settings={"--hidden-dim": 8}).fit(max_steps=1)
    with pytest.raises(ValueError, match="--hidden-dim"):
        make_trainer(trees, checkpoint_dir=str(other), settings={"--hidden-dim": 9})
    lines.clear()
    fresh = make_trainer(trees, seed=100, checkpoint_dir=str(tmp_path), resume=False, log=lines.append)
    assert fresh.next_step == 0 and fresh.resumed_from is None
    assert lines == [
        f"moved the 2 earlier checkpoint(s) in {tmp_path} to {tmp_path / 'earlier-1'} (resume=False: this run "
        "starts at step 0)"
    ]
    assert list_checkpoints(tmp_path) == []
    assert [step for step, _ in list_checkpoints(tmp_path / "earlier-1")] == [4, 6]


def test_evaluation_every_n_steps_and_every_epoch_reaches_stats_log_and_metrics_callbacks(
    trees: list[Tree],
) -> None:
    """evaluate(model, eval_data) runs in eval mode without grad after every eval_every steps and
    at the end of every eval_every_epochs epochs; its metrics are in those steps' stats, a log
    line and the metrics callbacks (eval/<name>), beside the training lines' train/<name>."""
    calls: list[tuple[bool, bool, Any]] = []

    def evaluate(model: torch.nn.Module, samples: list[Tree]) -> dict[str, Any]:
        calls.append((model.training, torch.is_grad_enabled(), samples))
        return {"count": len(samples), "zero": torch.zeros(())}

    lines: list[str] = []
    reported: list[tuple[int, dict[str, float]]] = []
    options = dict(evaluate=evaluate, eval_data=trees[:3], log=lines.append, log_every=5)
    trainer = make_trainer(
        trees, seed=100, eval_every=3, on_metrics=lambda step, m: reported.append((step, dict(m))), **options
    )
    history = trainer.fit()  # 14 steps, epoch 0 ends after step 7 (8 steps)
    assert [s.step for s in history if s.metrics] == [2, 5, 8, 11]
    assert history[2].metrics == {"count": 3.0, "zero": 0.0} and history[3].metrics == {}
    assert calls == [(False, False, trees[:3])] * 4 and trainer.model.training
    assert "eval at step 3 | count 3 | zero 0" in lines
    assert (3, {"eval/count": 3.0, "eval/zero": 0.0}) in reported
    train_lines = [(step, m) for step, m in reported if "train/loss" in m]
    assert [step for step, _ in train_lines] == [5, 10, 14]
    assert set(train_lines[0][1]) == {"train/loss", "train/lr", "train/batch_size", "train/samples_per_s"}
    by_epoch = make_trainer(trees, seed=100, **options)  # default: after every epoch
    history = by_epoch.fit()
    assert [s.step for s in history if s.metrics] == [7, 13]
    _, expected = _loop_run("linear")  # evaluating changes nothing in the run
    assert [s.loss for s in history] == [s.loss for s in expected]
    with pytest.raises(ValueError, match="there is no evaluate="):
        make_trainer(trees, eval_every=3)
    with pytest.raises(ValueError, match="eval_every must be"):
        make_trainer(trees, evaluate=evaluate, eval_every=0)


def test_bf16_runs_the_forward_and_loss_under_autocast_and_fp16_needs_cuda(trees: list[Tree]) -> None:
    """precision="bf16": each minibatch's forward and loss under CPU autocast; the parameters stay
    in their dtype and the run stays close to fp32 (the Tree-LSTM's Linear layers in bfloat16)."""
    seen: list[tuple[bool, torch.dtype]] = []

    def loss(model: torch.nn.Module, outputs: list[torch.Tensor], targets: Any) -> torch.Tensor:
        seen.append((torch.is_autocast_enabled("cpu"), model.logits(outputs[0]).dtype))  # type: ignore[operator]
        return tree_lstm_loss(model, outputs, targets)

    def trainer(precision: str) -> TraceTrainer:
        vocab = Vocab.build(trees)
        model = make_model(vocab, seed=100).float()  # (autocast leaves float64 alone)
        opt = AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
        loader = StepLoader(trees, MINIBATCH, build=TreeLSTMBuild(vocab), trace=12)
        return TraceTrainer(model, opt, loader, loss, progress=False, precision=precision)

    bf16 = trainer("bf16")
    history = bf16.fit(max_steps=4)
    assert seen and set(seen) == {(True, torch.bfloat16)}
    assert all(p.dtype == torch.float32 and p.grad is None for p in bf16.model.parameters())
    seen.clear()
    expected = trainer("fp32").fit(max_steps=4)
    assert set(seen) == {(False, torch.float32)}
    torch.testing.assert_close([s.loss for s in history], [s.loss for s in expected], rtol=0.02, atol=0.02)
    assert [s.loss for s in history] != [s.loss for s in expected]  # it did run in bfloat16
    with pytest.raises(ValueError, match="precision='fp16' needs a CUDA device"):
        make_trainer(trees, precision="fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        make_trainer(trees, precision="half")


def test_fit_sets_one_intra_op_thread_unless_the_user_chose_and_says_so_once(trees: list[Tree]) -> None:
    before = torch.get_num_threads()
    lines: list[str] = []
    try:
        trainer = make_trainer(trees, seed=100, num_threads=2, log=lines.append, log_every=1)
        trainer.fit(max_steps=1)
        assert torch.get_num_threads() == 2
        trainer.fit(max_steps=2)
        said = [line for line in lines if "thread" in line]
        assert said == ["2 intra-op CPU thread(s) per process (num_threads=2)"]  # once
    finally:
        torch.set_num_threads(before)


def test_a_step_mechanism_given_as_compile_is_the_trainers_own() -> None:
    """The command line makes one StepMechanism (to pad its folds and build its optimizer) and hands
    it to the trainer: the run decides how steps run once, not twice."""
    from torchfold.train import StepMechanism

    trees = sst_trees(8)
    mechanism = StepMechanism("cpu", compile="off")
    trainer = make_trainer(trees, compile=mechanism)
    assert trainer.mechanism is mechanism and trainer.compile == "off"
    with pytest.raises(ValueError, match=r"made for another run .*device is cpu.*StepMechanism\(device"):
        make_trainer(trees, compile=StepMechanism("meta", compile="off"))
    with pytest.raises(ValueError, match=r"compile_backend='eager'"):
        make_trainer(trees, compile=mechanism, compile_backend="eager")
    # made before the processes joined (or for another world): the deferral and the runner would be wrong
    with pytest.raises(
        ValueError, match=r"the run has 1 process\(es\), it was made for 4.*after init_distributed"
    ):
        make_trainer(trees, compile=StepMechanism("cpu", compile="off", world_size=4))
    # "cuda" is the current CUDA device: the same device as "cuda:0" (no CUDA needed to ask)
    from torchfold.train.distributed.devices import same_device

    assert same_device("cuda", "cuda:0") and not same_device("cuda:1", "cuda:0")
