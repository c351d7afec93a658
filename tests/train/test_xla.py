"""AccumulatingOptimizer on real torch_xla (its CPU backend): one device, and two replicas with xm.all_reduce.

Runs only in the XLA environment (``.venv-xla``, see the Makefile's ``test-xla``); the main suite
deselects it with ``-m "not xla"``. torch_xla is imported inside the tests, so that running them
without it fails instead of passing.
"""

from __future__ import annotations

import copy
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist_worker import make_model, mnist_rows, train
from _xla_worker import MINIBATCH, RULES, TRACE, train_on_xla

from tests.conftest import DATA_DIR
from torchfold.train.data.sampler import minibatches_per_rank

pytestmark = pytest.mark.xla
os.environ.setdefault("PJRT_DEVICE", "CPU")
REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "helpers"
# XLA's CPU kernels and PyTorch's sum in different orders; in float64 the parameters then differ by
# ~1e-9 at most after training, far below what a wrong scale, a lost or doubled minibatch would do.
TOLERANCE = {"rtol": 1e-6, "atol": 1e-8}


def _spawn_two_replicas(script: str, out: Path, timeout: float) -> Path:
    """Run ``tests/helpers/SCRIPT OUT`` on 2 XLA CPU devices in a fresh process (xmp.spawn needs an uninitialized runtime)."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    done = subprocess.run(
        [sys.executable, str(HELPERS / script), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _cpu_reference(rule: str) -> dict[str, object]:
    return train(make_model(seed=100), rule, mnist_rows(sum(TRACE)), TRACE, MINIBATCH, num_replicas=1, rank=0)


# (linear differs from constant only in the host's rate arithmetic, the CPU lane's; the two-replica
# test below runs every rule on XLA)
@pytest.mark.parametrize("rule", ["constant", "adascale"])
def test_one_xla_device_equals_the_cpu(rule: str) -> None:
    import torch_xla

    out = train_on_xla(rule, make_model(seed=100), mnist_rows(sum(TRACE)), num_replicas=1, rank=0)
    assert out["device"].startswith("xla")
    expected = _cpu_reference(rule)
    for p, q in zip(out["params"], expected["params"], strict=True):  # type: ignore[call-overload]
        torch.testing.assert_close(p, q, **TOLERANCE)
    assert out["factors"] == pytest.approx(expected["factors"], rel=1e-6)
    assert torch_xla.device().type == "xla"


def test_two_xla_replicas_with_all_reduce_equal_one_process(tmp_path: Path) -> None:
    # A fresh process: xmp.spawn needs an uninitialized runtime, and this one already ran above.
    out = _spawn_two_replicas("_xla_worker.py", tmp_path / "replicas.pt", timeout=400)
    for rank in (0, 1):
        replica = torch.load(f"{out}.rank{rank}", weights_only=False)
        assert (replica["world_size"], replica["rank"]) == (2, rank)
        for rule in RULES:
            got = replica["results"][rule]
            counts = [minibatches_per_rank(b, MINIBATCH, 2)[rank] for b in TRACE]
            assert got["local_minibatches"] == counts and 0 in [
                minibatches_per_rank(b, MINIBATCH, 2)[1] for b in TRACE
            ]
            expected = _cpu_reference(rule)
            for p, q in zip(got["params"], expected["params"], strict=True):  # type: ignore[call-overload]
                torch.testing.assert_close(p, q, **TOLERANCE)
            assert got["factors"] == pytest.approx(expected["factors"], rel=1e-6)


def test_fold_on_an_xla_device_equals_the_cpu() -> None:
    """The engine assumes no CPU: a Tree-LSTM fold (ints made on the device, merged gathers,
    int32 indices) gives the CPU's outputs and gradients on an XLA device."""
    import torch_xla

    from torchfold import Fold
    from torchfold.examples.datasets import Vocab, generate_sst
    from torchfold.examples.models import TreeLSTM, encode_trees

    trees = generate_sst(6, seed=2)
    vocab = Vocab.build(trees)
    results = []
    for device in (torch.device("cpu"), torch_xla.device()):
        torch.manual_seed(0)
        model = TreeLSTM(len(vocab), 8, 12).to(device)
        fold = Fold()
        nodes, labels, roots = encode_trees(fold, trees, vocab)
        states, root_states = fold.apply(model, [nodes, [nodes[r] for r in roots]])
        assert states.device.type == device.type
        loss = torch.nn.functional.cross_entropy(model.logits(states), torch.tensor(labels, device=device))
        (loss + root_states.sum()).backward()
        results.append([states, root_states] + [p.grad for p in model.parameters()])
    for cpu, xla in zip(*results, strict=True):
        torch.testing.assert_close(xla.cpu(), cpu, rtol=1e-5, atol=1e-6)


def _sst_batches(count: int, size: int) -> tuple[list[list[Any]], Any]:
    from torchfold.examples.datasets import Vocab, load_sst

    trees = load_sst(split="train", max_trees=count * size)
    return [trees[i * size : (i + 1) * size] for i in range(count)], Vocab.build(trees)


def _padded_step(
    model: torch.nn.Module, fold: Any, trees: list[Any], vocab: Any, device: torch.device
) -> torch.Tensor:
    """One Tree-LSTM training step's loss on padded outputs: a loss at every node, padded rows weighing 0."""
    from torchfold.examples.models import encode_trees

    nodes, labels, roots = encode_trees(fold, trees, vocab)
    plan = fold.plan([nodes])
    [states] = plan.apply(model, padded=True)
    sizes = [roots[0] + 1] + [b - a for a, b in itertools.pairwise(roots)]
    weights = [1 / (size * len(trees)) for size in sizes for _ in range(size)]
    losses = torch.nn.functional.cross_entropy(
        model.logits(states), plan.pad(0, labels).to(device), reduction="none"
    )
    return (losses * plan.pad(0, weights).to(device)).sum()


def test_static_shapes_stop_compiling_after_the_warm_up_on_sst_batches() -> None:
    """40 consecutive SST batches of 8 trees, a training step each: every compilation happens in the
    first 20 batches (the count is deterministic: the same data gives the same envelope)."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from torchfold import Fold, StaticShapes
    from torchfold.examples.models import TreeLSTM

    device = torch_xla.device()
    batches, vocab = _sst_batches(40, 8)
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 8, 8).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shapes = StaticShapes()

    def compilations() -> int:
        data = met.metric_data("CompileTime")
        return 0 if data is None else int(data[0])

    counts = [compilations()]
    for trees in batches:
        optimizer.zero_grad(set_to_none=True)
        _padded_step(model, Fold(shapes=shapes), trees, vocab, device).backward()
        optimizer.step()
        torch_xla.sync()
        counts.append(compilations())
    new = [b - a for a, b in itertools.pairwise(counts)]
    assert sum(new[20:]) == 0, f"compilations per batch: {new}"
    assert 1 <= sum(new[:20]) <= 2 * shapes.version + 1, (
        new
    )  # a graph per envelope version (+ the first step's)
    assert shapes.version <= 3


def test_a_training_step_on_static_shapes_makes_no_device_to_host_transfer() -> None:
    import torch_xla
    import torch_xla.debug.metrics as met

    from torchfold import Fold, StaticShapes
    from torchfold.examples.models import TreeLSTM

    device = torch_xla.device()
    batches, vocab = _sst_batches(2, 6)
    model = TreeLSTM(len(vocab), 8, 8).to(device)
    torch_xla.sync()

    def transfers() -> int:
        data = met.metric_data("TransferFromDeviceTime")
        return 0 if data is None else int(data[0])

    before = transfers()
    for trees in batches:
        _padded_step(model, Fold(shapes=StaticShapes()), trees, vocab, device).backward()
        torch_xla.sync()
    assert transfers() == before


def test_padded_plans_on_xla_equal_unpadded_ones_on_the_cpu() -> None:
    import torch_xla

    from torchfold import Fold, StaticShapes
    from torchfold.examples.models import TreeLSTM

    batches, vocab = _sst_batches(3, 5)
    shapes = StaticShapes()
    for trees in batches:  # the later batches are padded into an envelope the first one grew
        results = []
        for device, fold in (
            (torch.device("cpu"), Fold(shapes=None)),
            (torch_xla.device(), Fold(shapes=shapes)),
        ):
            torch.manual_seed(0)
            model = TreeLSTM(len(vocab), 8, 12).to(device)
            loss = _padded_step(model, fold, trees, vocab, device)
            loss.backward()
            results.append([loss] + [p.grad for p in model.parameters()])
        for cpu, xla in zip(*results, strict=True):
            torch.testing.assert_close(xla.cpu(), cpu, rtol=1e-5, atol=1e-6)
    assert shapes.waste > 0


def test_apply_on_xla_pads_by_default_and_returns_exact_outputs() -> None:
    import torch_xla

    from torchfold import Fold, StaticShapes
    from torchfold.examples.models import TreeLSTM, encode_trees

    batches, vocab = _sst_batches(1, 4)
    torch.manual_seed(0)
    model = TreeLSTM(len(vocab), 8, 8)
    outs = []
    for device in (torch.device("cpu"), torch_xla.device()):
        fold = Fold()
        nodes, _, _ = encode_trees(fold, batches[0], vocab)
        [states] = fold.apply(model.to(device), [nodes])
        outs.append(states.cpu())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    assert StaticShapes.of(model).plans == 1  # the XLA apply went through the module's envelope


# (two runs for three claims: ``auto`` and ``--pack-levels`` together, each a process of a minute)
@pytest.mark.parametrize(("device", "packed"), [("xla", False), ("auto", True)])
def test_the_train_cli_runs_on_xla_with_static_shapes(device: str, packed: bool) -> None:
    """``python -m torchfold train --device xla`` (and ``auto`` with PJRT_DEVICE set, there with
    ``--pack-levels``) trains on the XLA device, and says how many programs torch_xla compiled."""
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    args = [
        *(["--pack-levels"] if packed else []),
        "--device",
        device,
        "--trace",
        "8",
        "--max-train",
        "48",
        "--minibatch-size",
        "4",
        "--max-steps",
        "3",
    ]
    args += [
        "--embedding-dim",
        "8",
        "--hidden-dim",
        "8",
        "--no-progress",
        "--workers",
        "0",
        "--log-every",
        "1",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "torchfold", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "device xla:0" in done.stdout and "done: 3 steps (24 samples" in done.stdout, done.stdout
    assert "unpadded plan" not in done.stderr  # the CLI's build pads
    # torch_xla's own count (the warm-up's programs and every other graph of the run), at the end
    assert re.search(r"^compiled: [1-9]\d* graphs by torch_xla in this run", done.stdout, re.MULTILINE), (
        done.stdout
    )


def test_the_train_cli_fits_one_layout_for_lazy_steps_so_no_deeper_batch_compiles_late(
    tmp_path: Path,
) -> None:
    """A lazily traced step (the default on XLA) cannot compile a layout before a batch meets it,
    so the CLI's envelope has one layout of every level (``StepMechanism.static_shapes``): on a
    trace of 1 to 4 minibatches per step, 4 graphs in 16 steps (6 with depth buckets: the steps
    that first meet a deeper bucket compile again)."""
    args = ["--device", "xla", "--trace", "steps:4x4,16x4,8x4,12x4", "--minibatch-size", "4"]
    args += ["--max-train", "400", "--max-steps", "16", "--embedding-dim", "8", "--hidden-dim", "8"]
    args += ["--no-progress", "--workers", "0", "--log-every", "1", "--no-resume"]
    done = subprocess.run(
        [sys.executable, "-m", "torchfold", "train", "--data", str(DATA_DIR), *args],
        env={**os.environ, "PJRT_DEVICE": "CPU"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: 16 steps (160 samples" in done.stdout, done.stdout
    assert re.search(r"^compiled: 4 graphs by torch_xla in this run", done.stdout, re.MULTILINE), done.stdout


def test_a_default_step_loader_splits_every_step_between_two_xla_replicas(tmp_path: Path) -> None:
    # Defaults only: num_replicas and rank must both come from torch_xla (they once came
    # from two places: 2 replicas, both rank 0, half of every step never read).
    from _xla_loader_worker import BATCH, DATASET, TRACE

    from torchfold.train import StepLoader

    out = _spawn_two_replicas("_xla_loader_worker.py", tmp_path / "loader", timeout=300)
    replicas = [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in (0, 1)]
    assert [r["world"] for r in replicas] == [(2, 0, "torch_xla"), (2, 1, "torch_xla")]
    assert [r["loader"] for r in replicas] == [(2, 0), (2, 1)]
    whole = StepLoader(list(range(DATASET)), BATCH, trace=TRACE, seed=3, num_replicas=1, rank=0)
    expected = [sorted(i for mb in step for i in mb.indices) for step in whole]
    assert len(expected) == len(replicas[0]["steps"]) == len(replicas[1]["steps"])
    for number, samples in enumerate(expected):
        mine = [sorted(i for mb in r["steps"][number] for i in mb) for r in replicas]
        assert not set(mine[0]) & set(mine[1]), (
            f"step {number}: both replicas read {set(mine[0]) & set(mine[1])}"
        )
        assert sorted(mine[0] + mine[1]) == samples, f"step {number}"


SST_DIR = DATA_DIR / "sst"


def _trainer_replicas(
    tmp_path: Path, devices: int, *args: str
) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    """Run ``_xla_trainer_worker.py`` on ``devices`` XLA CPU devices; its exit and each replica's results."""
    out = tmp_path / "trainer.pt"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}
    done = subprocess.run(
        [sys.executable, str(HELPERS / "_xla_trainer_worker.py"), str(SST_DIR), str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return done, [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(devices)]


# (replayed steps on one device, against one CPU process, compiling nothing after the warm-up: the
# resumed run of test_a_checkpoint_of_two_xla_devices_resumes_on_one_with_replayed_steps)
@pytest.mark.parametrize(("compile", "devices", "steps"), [("off", 2, 8), ("replay", 2, 32)])
def test_the_trainer_on_xla_devices_equals_one_cpu_process(
    tmp_path: Path, compile: str, devices: int, steps: int
) -> None:
    """TraceTrainer with static-shape plans on 1 or 2 XLA CPU replicas (xm.all_reduce), lazy or with
    replayed steps (SGD with momentum through the minibatch and update programs), follows a trace
    whose steps give the replicas 0 to 4 minibatches; the parameters equal one CPU process's, the
    steps that repeat earlier minibatch counts compile nothing new, and a resume from the step-16
    checkpoint continues the same run.
    Two CPU devices are threads of one process: each captures its own step, and they meet before
    every all-reduce, however long a capture takes."""
    import torch_xla

    torch_xla.device()  # XLA's devices exist before this process's first backward (autograd counts them then)

    sys.path.insert(0, str(HELPERS))
    from _xla_trainer_worker import TRACE, train_on_cpu

    done, replicas = _trainer_replicas(tmp_path, devices, compile, str(steps))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = train_on_cpu(str(SST_DIR), steps)
    for rank, replica in enumerate(replicas):
        assert (replica["world_size"], replica["rank"]) == (devices, rank)
        # no torch.compile capture: with compile="replay" every step is replayed (XlaRunner), on one device or two
        assert replica["captures"] == 0
        assert replica["update"] == "NoneType"
        # every step replayed (the minibatch programs; with two replicas an all-reduce; the update
        # program), SGD's too: one layout, so one minibatch program and one update program (the
        # first update, which made the momentum buffers, is not kept), none refused (tests for the
        # replays themselves: test_xla_runner.py, the Adam test below and
        # test_replayed_steps_on_xla_equal_eager_steps_on_the_cpu)
        replayed = compile == "replay"
        assert replica["programs"] == (2 if replayed else 0), replica["programs"]
        assert replica["refused"] is None, replica["refused"]
        assert not [w for w in replica["warnings"] if "replays each captured step" not in w], replica[
            "warnings"
        ]
        compilations = replica["compilations"]
        assert len(compilations) == len(TRACE[:steps])
        # every minibatch count (on every replica) has been seen by the trace's first repeat; the
        # first checkpoint (written once 16 steps have run) compiles its transfers (and, on two
        # devices, its gather) once, counted with step 16 (the 17th)
        warm = min(7, steps // 2 - 1)
        ends = [steps - 1] if steps <= 16 else [14, steps - 1]
        assert all(compilations[end] == compilations[warm if end < 15 else 16] for end in ends), str(
            compilations
        )
        for p, q in zip(replica["params"], expected, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
        if steps > 16:  # resumed from the step-16 checkpoint (every replica's generators in it)
            for r, p in zip(replica["resumed_params"], replica["params"], strict=True):
                torch.testing.assert_close(r, p, rtol=1e-5, atol=1e-6)
    if devices == 2:
        counts = [replica["local_minibatches"] for replica in replicas]
        assert counts[0] != counts[1] and 0 in counts[1]


@pytest.mark.timeout(1200)  # two trainer runs in subprocesses (900 s each at most), compiling on a shared CPU
def test_a_checkpoint_of_two_xla_devices_resumes_on_one_with_replayed_steps(tmp_path: Path) -> None:
    """Adam (capturable), replayed steps: a run on 2 XLA CPU devices writes its step-16 checkpoint;
    a run on 1 device resumes from it (its steps replayed through the same minibatch and update
    programs) and ends where the 2-device run and one eager CPU process end,
    compiling nothing new once every minibatch count has come round twice."""
    import torch_xla

    torch_xla.device()
    sys.path.insert(0, str(HELPERS))
    from _xla_trainer_worker import CHECKPOINT_STEP, TRACE, train_on_cpu

    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir()
    one.mkdir()
    done, replicas = _trainer_replicas(two, 2, "replay", "32", "--optimizer", "adam")
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoints = two / "trainer.pt.checkpoints"
    done, [resumed] = _trainer_replicas(
        one, 1, "replay", "32", "--optimizer", "adam", "--resume", str(checkpoints)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = train_on_cpu(str(SST_DIR), 32, optimizer="adam")
    # Adam divides by the root of tiny second moments: float32 sums in another order move a few
    # parameters by ~1e-5 after 32 steps (a wrong gradient, rate or state moves all by ~lr)
    for p, q, r in zip(replicas[0]["params"], expected, resumed["resumed_params"], strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(r, q, rtol=1e-3, atol=1e-4)
    # two replicas: the minibatch and update programs on each (an all-reduce between them), none
    # refused, and nothing compiled once every minibatch count has come round (from step 7), but
    # the checkpoint written once 16 steps have run: its transfers and gather, compiled once and
    # counted with step 16 (the 17th)
    for replica in replicas:
        assert replica["programs"] >= 2 and replica["refused"] is None, (
            replica["programs"],
            replica["refused"],
        )
        assert not [w for w in replica["warnings"] if "not replayed" in w], replica["warnings"]
        counts = replica["compilations"]
        assert counts[14] == counts[7] and counts[-1] == counts[16], str(counts)
    # the runner replayed programs, none refused (the loaded, equal step counts of Adam have a
    # buffer each: test_capture_regressions.py); the one warning says that random draws of a run
    # resumed on another number of devices differ without seed=
    assert resumed["replays"] >= 1
    assert resumed["refused"] is None, resumed["refused"]
    assert not [w for w in resumed["warnings"] if "not replayed" in w], resumed["warnings"]
    # the replay's contract, said once when its runner is made, and the resume's one warning
    contract = [w for w in resumed["warnings"] if "replays each captured step" in w]
    assert len(contract) == 1, resumed["warnings"]
    others = [w for w in resumed["warnings"] if w not in contract]
    assert [w for w in others if "world-size invariantly" in w] == others and others, resumed["warnings"]
    compilations = resumed["compilations"]
    assert len(compilations) == len(TRACE) - CHECKPOINT_STEP
    assert compilations[-1] == compilations[7], str(compilations)


def test_trainer_xla_script_quick(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/trainer_xla.py at minimal size: the trainer command on the CPU and on XLA, in
    fresh processes, the same last loss."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import trainer_xla

    cpu, xla = trainer_xla.main(["--quick", "--data", str(DATA_DIR)])
    assert (cpu["variant"], xla["variant"]) == ("cpu/off", "xla/auto")
    assert xla["last loss"] == pytest.approx(cpu["last loss"], rel=1e-4)
    assert "xla/auto / cpu: median" in capsys.readouterr().out


def test_a_failing_replica_thread_stops_the_others_at_once(tmp_path: Path) -> None:
    """Replica 1's loss raises: replica 0, waiting for it before an all-reduce, stops with an error
    saying so (instead of waiting out the timeout, or XLA aborting the process)."""
    done, replicas = _trainer_replicas(tmp_path, 2, "off", "8", "--fail-rank", "1")
    assert done.returncode != 0
    assert replicas[1]["error"] == "ValueError: injected failure on rank 1"
    assert replicas[0]["error"].startswith(
        "RuntimeError: torchfold: replica 0 of 2 XLA replicas in this process"
    ), replicas[0]["error"]
    assert "one of them failed" in replicas[0]["error"]


def _replayed_step(programs: Any, plan: Any, targets: Any, lrs: list[float], num_samples: int) -> float:
    """One step of one minibatch through XlaPrograms (``reduction="mean"``, a minibatch unit of 1):
    the minibatch program, then the update program; the step's loss (its loss sum over its samples)."""
    programs.run_minibatch(plan, targets, num_samples)
    return float(programs.update(lrs, num_samples)) / num_samples


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_replayed_steps_on_xla_equal_eager_steps_on_the_cpu(kind: str) -> None:
    """XlaPrograms: forward, loss and backward of each layout traced once (its minibatch program),
    the update once per optimizer configuration (its update program), then replayed with new
    batches and a learning rate that changes at every step; losses and parameters equal plain
    eager steps on the CPU. A changed optimizer option is read by the same update program, never
    a stale graph. SGD, whose tensor learning rate requires grad inside the trace (so torch multiplies by
    it instead of reading it back to the host), replays too."""
    import warnings

    import torch_xla

    from torchfold import StaticShapes
    from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
    from torchfold.train import to_device
    from torchfold.train.capture import XlaPrograms

    batches, vocab = _sst_batches(8, 4)
    shapes = StaticShapes()
    for trees in batches:
        shapes.cover(TreeLSTMBuild(vocab)(trees)[0])  # type: ignore[arg-type]
    device = torch_xla.device()

    def make(on: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TreeLSTM(len(vocab), 8, 8).to(on)
        if kind == "sgd":
            return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, torch.optim.Adam(model.parameters(), lr=0.01, capturable=on.type == "xla")

    (model, optimizer), (reference, plain) = make(device), make(torch.device("cpu"))
    programs = XlaPrograms(model, tree_lstm_loss, optimizer)
    assert programs.transpose_weights  # the default on XLA's CPU backend: linear layers' products re-laid
    build, unpadded = TreeLSTMBuild(vocab, shapes=shapes), TreeLSTMBuild(vocab)
    losses, expected = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number, trees in enumerate(batches * 2):
            rate = (0.01 if kind == "adam" else 0.1) * (1 + number % 3) / 2
            if number == 10 and kind == "adam":
                for group in optimizer.param_groups + plain.param_groups:
                    group["betas"] = (0.8, 0.99)  # an option: read at the step, by the same program
            plan, targets = build(trees)
            losses.append(_replayed_step(programs, plan, to_device(targets, device), [rate], len(trees)))
            for group in plain.param_groups:
                group["lr"] = rate
            plain.zero_grad()
            plan, targets = unpadded(trees)
            loss = tree_lstm_loss(reference, plan.apply(reference), to_device(targets, torch.device("cpu")))
            loss.backward()
            plain.step()
            expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-4)
    # Adam divides by the root of tiny second moments: float32 rounding apart in the 7th digit
    # moves a few parameters by ~1e-5 after 16 steps (a wrong gradient or rate moves all by ~lr)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-3, atol=1e-4)
    messages = [str(w.message) for w in caught]
    assert programs.refused is None and not messages, messages
    layouts = {build(trees)[0].layout.key for trees in batches}  # type: ignore[union-attr]
    # a minibatch program per layout; one update program (the first update, which made the
    # optimizer's state, is not kept; the changed betas are the same program's inputs)
    assert programs.captures == len(layouts) + 1, (programs.captures, layouts)


def test_a_replayed_step_keeps_frozen_parameters_buffers_and_a_reset_state_right() -> None:
    """XlaPrograms write back only what a step changed (a frozen parameter stays as it was, every
    other result lands in its own tensor), read the module's buffers as inputs (a changed buffer
    changes the next replay, with no new program), make the optimizer's state again after it was
    reset, and trace a batch of other shapes anew instead of feeding a program the wrong shapes;
    losses and parameters equal eager steps on the CPU throughout."""
    import torch_xla

    from torchfold import StaticShapes
    from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
    from torchfold.train import to_device
    from torchfold.train.capture import XlaPrograms

    batches, vocab = _sst_batches(2, 4)
    shapes = StaticShapes()
    for trees in batches:
        shapes.cover(TreeLSTMBuild(vocab)(trees)[0])  # type: ignore[arg-type]
    device, cpu = torch_xla.device(), torch.device("cpu")

    def make(on: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TreeLSTM(len(vocab), 8, 8).to(on)
        model.register_buffer("scale", torch.ones((), device=on))
        list(model.parameters())[1].requires_grad_(False)  # frozen: no gradient, no update
        return model, torch.optim.Adam(model.parameters(), lr=0.01, capturable=on.type == "xla")

    def scaled_loss(model: torch.nn.Module, outputs: Any, targets: Any) -> torch.Tensor:
        return tree_lstm_loss(model, outputs, targets) * model.scale

    def eager_step(trees: list[Any]) -> float:
        plain.zero_grad()
        plan, targets = unpadded(trees)
        loss = scaled_loss(reference, plan.apply(reference), to_device(targets, cpu))
        loss.backward()
        plain.step()
        return loss.item()

    (model, optimizer), (reference, plain) = make(device), make(cpu)
    frozen = list(reference.parameters())[1].detach().clone()
    fresh = [copy.deepcopy(opt.state_dict()) for opt in (optimizer, plain)]
    programs = XlaPrograms(model, scaled_loss, optimizer)
    build, unpadded = TreeLSTMBuild(vocab, shapes=shapes), TreeLSTMBuild(vocab)
    losses, expected = [], []
    for number in range(8):
        trees = batches[number % 2]
        if number == 4:  # a buffer changed between steps
            for m in (model, reference):
                m.scale.fill_(0.5)  # type: ignore[operator]
        if number == 6:  # the optimizer reset to its state before any step
            for opt, state in zip((optimizer, plain), fresh, strict=True):
                opt.load_state_dict(state)
        plan, targets = build(trees)
        losses.append(_replayed_step(programs, plan, to_device(targets, device), [0.01], len(trees)))
        expected.append(eager_step(trees))
    assert losses == pytest.approx(expected, rel=1e-4)
    assert len(optimizer.state) == len(plain.state) == 6  # the reset state made again
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-3, atol=1e-4)
    assert torch.equal(list(model.parameters())[1].detach().cpu(), frozen)
    layouts = {build(trees)[0].layout.key for trees in batches}  # type: ignore[union-attr]
    # a minibatch program per layout, one update program: the changed buffer is an input, and the
    # update that made the reset state again is not kept (the next one replays the program of old)
    assert programs.captures == len(layouts) + 1, (programs.captures, layouts)
    # weights of another length: traced anew, so the loss itself says what is wrong
    plan, (labels, weights) = build(batches[0])
    labels, weights = to_device((labels, weights), device)
    count = len(batches[0])
    with pytest.raises(RuntimeError, match=r"[Ss]hape"):
        programs.run_minibatch(plan, (labels, torch.cat([weights, weights])), count)
    # and the next step of the right shapes runs as before, still equal to the CPU's
    after = _replayed_step(programs, plan, (labels, weights), [0.01], count)
    assert after == pytest.approx(eager_step(batches[0]), rel=1e-4)
    assert programs.refused is None and programs.captures == len(layouts) + 1
    # a state dict that turns capturable off: that step and the next run lazily, with one warning
    # naming the fix, and still train as the CPU does
    uncapturable = copy.deepcopy(optimizer.state_dict())
    uncapturable["param_groups"][0]["capturable"] = False
    optimizer.load_state_dict(uncapturable)
    for state in optimizer.state.values():
        state["step"] = state["step"].cpu()  # where a non-capturable Adam keeps its step count
    with pytest.warns(UserWarning, match="capturable=True"):
        lazy = _replayed_step(programs, build(batches[0])[0], (labels, weights), [0.01], count)
    assert programs.refused is not None and lazy == pytest.approx(eager_step(batches[0]), rel=1e-4)
    plan, targets = build(batches[1])
    lazy = _replayed_step(programs, plan, to_device(targets, device), [0.01], len(batches[1]))
    assert lazy == pytest.approx(eager_step(batches[1]), rel=1e-4)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-3, atol=1e-4)


def test_a_schedule_of_optimizer_options_replays_one_program_and_a_tensor_option_is_refused() -> None:
    """Adam's betas, eps and weight decay changed at every step (a ``OneCycleLR``'s way): the one
    update program runs on the values they give, with no compile after the first steps, and the
    steps equal the CPU's. A tensor in a param group would be frozen at its traced value: refused."""
    import warnings

    import torch_xla

    from torchfold import StaticShapes
    from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
    from torchfold.train import to_device
    from torchfold.train.capture import XlaPrograms
    from torchfold.train.distributed.xla_calls import compilations

    [trees], vocab = _sst_batches(1, 4)
    shapes = StaticShapes()
    shapes.cover(TreeLSTMBuild(vocab)(trees)[0])  # type: ignore[arg-type]
    device, cpu = torch_xla.device(), torch.device("cpu")

    def make(on: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TreeLSTM(len(vocab), 8, 8).to(on)
        return model, torch.optim.Adam(model.parameters(), lr=0.01, capturable=on.type == "xla")

    (model, optimizer), (reference, plain) = make(device), make(cpu)
    programs = XlaPrograms(model, tree_lstm_loss, optimizer)
    plan, targets = TreeLSTMBuild(vocab, shapes=shapes)(trees)
    unpadded, unpadded_targets = TreeLSTMBuild(vocab)(trees)
    losses, expected, compiled = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number in range(8):
            for opt in (optimizer, plain):
                group = opt.param_groups[0]
                group["betas"] = (0.9 - 0.02 * number, 0.999 - 0.001 * number)
                group["eps"], group["weight_decay"] = 1e-8 * (1 + number), 0.01 * (1 + number)
            losses.append(_replayed_step(programs, plan, to_device(targets, device), [0.01], len(trees)))
            compiled.append(compilations())
            plain.zero_grad()
            loss = tree_lstm_loss(reference, unpadded.apply(reference), to_device(unpadded_targets, cpu))
            loss.backward()
            plain.step()
            expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-4)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-3, atol=1e-4)
    assert programs.refused is None and not caught, [str(w.message) for w in caught]
    # the minibatch program and one update program (the first update made the state: not kept);
    # steps 0-2 capture and verify them, no later step compiles
    assert programs.captures == 2
    assert compiled[2:] == [compiled[2]] * 6, compiled

    fresh = XlaPrograms(model, tree_lstm_loss, optimizer)
    optimizer.param_groups[0]["scale"] = torch.ones((), device=device)  # an option of the user's
    with pytest.warns(UserWarning, match="param group 0's 'scale' is a tensor"):
        _replayed_step(fresh, plan, to_device(targets, device), [0.01], len(trees))
    assert fresh.refused is not None and "'scale' is a tensor" in fresh.refused
    assert fresh.captures == 1  # the minibatch program; no update program


def test_a_replayed_step_refuses_an_empty_param_group_naming_the_fix() -> None:
    """An empty param group has no parameter to place its learning rate by: one clear error."""
    import torch_xla

    from torchfold import StaticShapes
    from torchfold.examples.models import TreeLSTM, TreeLSTMBuild, tree_lstm_loss
    from torchfold.train import to_device
    from torchfold.train.capture import XlaPrograms

    [trees], vocab = _sst_batches(1, 2)
    device = torch_xla.device()
    model = TreeLSTM(len(vocab), 4, 4).to(device)
    optimizer = torch.optim.Adam(
        [{"params": list(model.parameters())}, {"params": []}], lr=0.01, capturable=True
    )
    plan, targets = TreeLSTMBuild(vocab, shapes=StaticShapes())(trees)
    programs = XlaPrograms(model, tree_lstm_loss, optimizer)
    with pytest.raises(ValueError, match="parameters in every param group; remove the empty groups"):
        _replayed_step(programs, plan, to_device(targets, device), [0.01, 0.01], len(trees))


@pytest.mark.timeout(900)  # two XLA runs that compile: minutes on a loaded 2-core machine
def test_xla_profile_script_quick(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/xla_profile.py at minimal size: a profiler trace of replayed steps, alone and in the
    trainer, read back as the time of the compiled programs' operations per step (counted however
    the executions ran: on the pool, or inline on a loaded machine)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import xla_profile

    results = xla_profile.main(["--quick", "--data", str(DATA_DIR)])
    for run in ("alone", "trainer"):
        result = results[run]
        assert result["steps"] >= 1
        assert result["wall"] > 0 and result["operations"] > 0  # (two threads may overlap operations)
        assert result["kinds"]["dot"] > 0  # the model's matrix products ran in the traced programs
    assert "its operations, summed" in capsys.readouterr().out


def test_xla_dots_script_quick(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/xla_dots.py at minimal size: each kind of product timed from the profiler's dot
    operations (the script refuses a trace without exactly one dot per product)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import xla_dots

    table = xla_dots.main(["--quick"])
    assert [row[1] for row in table] == list(xla_dots.KINDS)
    assert all(row[2] > 0 and row[3] > 0 for row in table)  # XLA's and eager's microseconds
    assert "| product " in capsys.readouterr().out


def test_linear_layers_trace_against_a_transposed_copy_of_the_weight_on_xla() -> None:
    """On XLA, ``transposed_weights`` gives ``F.linear``'s values and gradients, and the traced graph
    holds the optimization barrier that keeps XLA from folding the transpose back into the product
    (what makes the forward product fast on the CPU backend: ``benchmarks/xla_dots.py``)."""
    import torch_xla

    from torchfold.train.capture.xla_linear import transposed_weights

    device = torch_xla.device()
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 5)
    x = torch.randn(7, 6)
    results = []
    for on, transposed in ((torch.device("cpu"), False), (device, True)):
        copy, rows = torch.nn.Linear(6, 5).to(on), x.to(on).detach().requires_grad_()
        copy.load_state_dict(layer.state_dict())
        with transposed_weights() as mode:
            y = copy(rows)
            if transposed:
                assert mode.calls == 1
                assert "opt-barrier" in torch_xla._XLAC._get_xla_tensors_hlo([y])
        (y * torch.arange(5.0, device=on)).sum().backward()
        results.append([y, rows.grad, copy.weight.grad, copy.bias.grad])
    for cpu, xla in zip(*results, strict=True):
        torch.testing.assert_close(xla.cpu(), cpu.detach(), rtol=1e-5, atol=1e-6)
