"""Smoke tests for benchmarks/: each script's code path at minimal size, and that its versions agree.

Nothing here asserts a timing: the benchmarks print their measurements, the tests only check
that the compared versions compute the same losses and outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import autobatch_parser  # noqa: E402
import autobatch_schedule  # noqa: E402
import autobatch_tree_lstm  # noqa: E402
import coroutine_switch  # noqa: E402
import dynamo_guards  # noqa: E402
import fold_overhead  # noqa: E402
import gpu_tree_lstm  # noqa: E402
import harness  # noqa: E402
import mnist  # noqa: E402
import profile_tree_lstm  # noqa: E402
import pyast  # noqa: E402
import scaling  # noqa: E402
import schedules  # noqa: E402
import slow_transform  # noqa: E402
import trainer_tree_lstm  # noqa: E402
import trainer_xla  # noqa: E402
import tree_lstm  # noqa: E402
import xla  # noqa: E402
import xla_profile  # noqa: E402

import torchfold  # noqa: E402
from torchfold.engine import native  # noqa: E402
from torchfold.examples.datasets import Vocab, generate_sst, generate_sst_lines  # noqa: E402
from torchfold.examples.models import MLP, SiblingTreeLSTM, TreeLSTM  # noqa: E402
from torchfold.examples.pyast import AstSample  # noqa: E402

DYNET_PYTHON = BENCHMARKS.parent / ".venv-dynet" / "bin" / "python"


def _batch(num_trees: int, seed: int) -> tuple[tree_lstm.Batch, Vocab]:
    trees = generate_sst(num_trees, seed=seed, max_words=9)
    vocab = Vocab.build(trees)
    flat = [tree_lstm.flatten(t, vocab) for t in trees]
    return tree_lstm.Batch(trees, flat, tree_lstm.make_plan(flat), vocab), vocab


@pytest.mark.parametrize("model_name", list(tree_lstm.MODELS))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", tree_lstm.CONFIGS)
def test_tree_lstm_versions_compute_the_same_loss_and_gradients(
    seed: int, config: str, model_name: str
) -> None:
    batch, vocab = _batch(6, seed)
    torch.manual_seed(seed)
    model = tree_lstm.MODELS[model_name](len(vocab), 6, 7)
    grads = {}
    for name, loss_fn in tree_lstm.VERSIONS.items():
        copy_ = tree_lstm.with_config(model, config)
        loss = loss_fn(copy_, batch)
        loss.backward()
        assert copy_.embedding.weight.grad is not None
        assert copy_.embedding.weight.grad.is_sparse == (config == "sparse")
        tree_lstm.densify_embedding_grad(copy_)
        grads[name] = (loss.detach(), [p.grad for p in copy_.parameters()])
    ref_loss, ref_grads = grads["eager"]
    for loss, param_grads in grads.values():
        torch.testing.assert_close(loss, ref_loss)
        for g, r in zip(param_grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_tree_lstm_sparse_trainers_take_the_same_lazy_adam_steps() -> None:
    """Sparse configuration: SparseAdam + Adam, the same updates whichever version computes the loss."""
    batch, vocab = _batch(6, 4)
    torch.manual_seed(4)
    model = TreeLSTM(len(vocab), 6, 7)
    # a second batch of some of the same trees: its words are partly new to the optimizer's state, partly not
    batches = [
        batch,
        tree_lstm.Batch(batch.trees[3:], batch.flat[3:], tree_lstm.make_plan(batch.flat[3:]), vocab),
    ]
    trainers = {
        name: tree_lstm.Trainer(tree_lstm.with_config(model, "sparse"), fn, batches, 1e-2)
        for name, fn in tree_lstm.VERSIONS.items()
    }
    for trainer in trainers.values():
        assert [type(o).__name__ for o in trainer.optimizers] == ["Adam", "SparseAdam"]
        for _ in range(3):
            trainer.step()
    reference = trainers["eager"]
    for trainer in trainers.values():
        torch.testing.assert_close(torch.tensor(trainer.losses), torch.tensor(reference.losses))
        for p, q in zip(trainer.model.parameters(), reference.model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_hand_plan_dedups_and_covers_every_node() -> None:
    batch, _ = _batch(10, 3)
    plan = batch.plan
    assert plan.num_nodes == sum(len(t) for t in batch.trees)
    assert plan.num_unique < plan.num_nodes  # generated trees share words, so leaves repeat
    assert len(plan.node_rows) == plan.num_nodes and int(plan.node_rows.max()) < plan.num_unique
    assert len(set(plan.leaf_words.tolist())) == len(plan.leaf_words)  # each word's leaf computed once


def test_tree_lstm_script_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "trees.txt"
    data.write_text("\n".join(generate_sst_lines(20, seed=5)) + "\n")
    rates = tree_lstm.main(["--quick", "--data", str(data)])
    assert set(rates) == {
        tree_lstm.label(name, config) for name in tree_lstm.VERSIONS for config in tree_lstm.CONFIGS
    }
    out = capsys.readouterr().out
    assert "every version agrees in both configurations" in out and "| torchfold (sparse)" in out


@pytest.mark.skipif(
    not DYNET_PYTHON.exists(), reason="no .venv-dynet (python3 -m venv .venv-dynet && pip install dynet38)"
)
@pytest.mark.parametrize("model_name", list(tree_lstm.MODELS))
def test_tree_lstm_dynet_matches_pytorch_first_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model_name: str
) -> None:
    data = tmp_path / "trees.txt"
    data.write_text("\n".join(generate_sst_lines(20, seed=6)) + "\n")
    rates = tree_lstm.main(
        ["--quick", "--data", str(data), "--dynet-python", str(DYNET_PYTHON), "--model", model_name]
    )
    # main raises if DyNet's first-batch loss or warm-up losses differ from PyTorch's (in each configuration)
    assert {"dynet (dense)", "dynet (sparse)"} <= set(rates)
    assert "sparse (its default) Adam updates" in capsys.readouterr().out


def test_trainer_script_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "trees.txt"
    data.write_text("\n".join(generate_sst_lines(40, seed=0)) + "\n")
    rates = trainer_tree_lstm.main(["--quick", "--data", str(data)])  # checks the first losses agree
    assert set(rates) == {"hand-batched", "TraceTrainer"} and all(r > 0 for r in rates.values())
    assert "| TraceTrainer " in capsys.readouterr().out


def test_trainer_xla_script_quick_on_the_cpu(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CPU half of benchmarks/trainer_xla.py (both halves: the XLA lane's test of the same name)."""
    run, in_process = trainer_xla.main(
        ["--quick", "--variants", "cpu/off,cpu/off/0", "--data", str(data_dir)]
    )
    assert run["variant"] == "cpu/off" and run["sentences/s"] > 0 and run["vs cpu"] == 1.0
    assert "| 1     | cpu/off" in capsys.readouterr().out
    # folds built in the trainer's process (--workers 0) instead of a worker: the same training
    assert in_process["variant"] == "cpu/off/0" and in_process["last loss"] == run["last loss"]
    for bad in ("tpu/on", "xla/auto/x", "xla/auto/packed/0"):
        with pytest.raises(SystemExit):
            trainer_xla.main(["--quick", "--variants", bad, "--data", str(data_dir)])
        assert f"'{bad}' is not DEVICE/COMPILE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trainer_xla.main(["--quick", "--variants", "cpu/off/packed", "--data", str(data_dir)])
    assert "'cpu/off/packed' packs static shapes" in capsys.readouterr().err


def test_slow_transform_script_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "trees.txt"
    data.write_text("\n".join(generate_sst_lines(40, seed=0)) + "\n")
    result = slow_transform.main(["--quick", "--data", str(data)])
    # (times only: which is larger depends on the machine's load, so it is reported, not asserted)
    assert set(result) == {"train_only_ms", "data_build_ms", "sync_ms", "async_ms", "hidden"}
    assert all(result[name] > 0 for name in ("train_only_ms", "data_build_ms", "sync_ms", "async_ms"))
    assert "asynchronous loader hides" in capsys.readouterr().out


def test_xla_candidates_count_graphs_on_the_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The host-only part of benchmarks/xla.py (the XLA runs need torch_xla: see the XLA lane)."""
    (tmp_path / "train.txt").write_text("\n".join(generate_sst_lines(60, seed=0)) + "\n")
    xla.main(
        [
            "--candidates",
            "--data",
            str(tmp_path / "train.txt"),
            "--trees",
            "5",
            "--batches",
            "12",
            "--warmup",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert "| no padding " in out and "| grow-only envelope (StaticShapes) " in out


def test_profile_script_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "trees.txt"
    data.write_text("\n".join(generate_sst_lines(12, seed=7)) + "\n")
    times = profile_tree_lstm.main(["--quick", "--data", str(data)])
    assert times["torchfold total"] > 0 and times["hand total"] > 0
    out = capsys.readouterr().out
    assert "after gc.freeze()" in out and "run_backward" in out


def test_mnist_fold_stacked_and_single_agree() -> None:
    torch.manual_seed(0)
    model = MLP(784, (20, 10), 10)
    images, labels = torch.rand(40, 784), torch.randint(0, 10, (40,))
    mnist.check_same(model, images, labels, batch=8, lr=1e-3)  # raises if they differ
    rows = range(3, 11)
    torch.testing.assert_close(
        mnist.fold_forward(model, images, rows), mnist.single_forward(model, images, rows)
    )


def test_mnist_script_quick(capsys: pytest.CaptureFixture[str]) -> None:
    rates = mnist.main(["--quick"])
    assert {"forward/torchfold", "train/torchfold", "train/stacked"} <= set(rates)
    assert "old notebook: 14.7x" in capsys.readouterr().out


def test_pyast_hand_batching_matches_eager_and_the_fold() -> None:
    leaf, chain = (1, ()), (2, ((1, ()), (3, ()), (1, ()), (4, ((1, ()), (1, ())))))
    trees = [chain, leaf, (5, (chain, leaf, chain)), chain, (6, ((7, (leaf,)),))]  # repeats, a lone leaf
    samples = [AstSample(tree, i % 2, f"x.py:{i} f", 1, 1) for i, tree in enumerate(trees)]
    batches = pyast.make_batches(samples, 3)
    assert [len(b.samples) for b in batches] == [3, 2]
    # leaves 1 and 3; the chain's 4 merges and 2 nodes; 5's 2 merges and its node: computed once each
    plan = batches[0].fold[0]
    assert isinstance(plan, torchfold.FoldPlan)
    assert batches[0].hand.calls == plan.num_nodes == 11
    assert len(batches[0].hand.steps) + 1 == len(plan.groups)  # the same (depth, op) groups
    torch.manual_seed(0)
    pyast.check_same(SiblingTreeLSTM(8, 4, 6), batches)  # raises if they differ


def test_pyast_script_quick(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(torchfold.__file__).parent / "examples"
    seconds = pyast.main(["--root", str(root), "--functions", "8", "--minibatch", "4", "--rounds", "1"])
    assert set(seconds) == set(pyast.VERSIONS)
    out = capsys.readouterr().out
    assert "hand roots == Fold roots" in out and "x hand (run only)" in out


def test_fold_overhead_script_quick(capsys: pytest.CaptureFixture[str]) -> None:
    rows = fold_overhead.main(["--quick"])
    assert [row[0] for row in rows] == ["chain", "balanced", "forest"]
    assert all(isinstance(row[1], int) and row[1] >= 19 for row in rows)
    chain = rows[0]
    assert chain[1] == chain[2] == 20  # a chain: every node is its own group
    assert "apply us/node" in capsys.readouterr().out


def test_fold_overhead_recording_table_quick(capsys: pytest.CaptureFixture[str]) -> None:
    ((asked, nodes, add_us, python_add_us, plan_us, python_plan_us, loop_us),) = fold_overhead.main(
        ["--quick", "--recording"]
    )
    assert asked == nodes == 100  # every node distinct
    assert all(
        isinstance(t, float) and t > 0 for t in (add_us, python_add_us, plan_us, python_plan_us, loop_us)
    )
    out = capsys.readouterr().out
    assert "Python plan us/node" in out and "Python add us/call" in out and "as installed (C)" in out
    assert native.enabled()  # switched back after the Python turn


@pytest.mark.parametrize("shape", list(fold_overhead.BUILDERS))
def test_fold_overhead_graphs_evaluate_like_eager(shape: str) -> None:
    import random

    import torchfold

    model = fold_overhead.Trivial()
    fold = torchfold.Fold()
    roots = fold_overhead.BUILDERS[shape](fold, 30, random.Random(1))
    unfold = torchfold.EagerFold(model)
    # The builders only call add(), which EagerFold shares with Fold.
    eager_roots: Any = fold_overhead.BUILDERS[shape](unfold, 30, random.Random(1))  # type: ignore[arg-type]
    torch.testing.assert_close(fold.apply(model, [roots])[0], unfold.apply(model, [eager_roots])[0])


def test_scaling_script_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "trees.txt"
    data.write_text("\n".join(generate_sst_lines(30, seed=2)) + "\n")
    result = scaling.main(["--quick", "--data", str(data)])
    forests = result["forests"]
    assert [f["nodes"] >= size for f, size in zip(forests, (300, 1000), strict=True)] == [True, True]
    assert all(0 < f["distinct"] <= f["nodes"] and f["groups"] > 1 for f in forests)
    assert [r["trees"] for r in result["batches"]] == [4, 8]
    assert "peak RSS KB/node" in capsys.readouterr().out


def test_gpu_script_quick_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU benchmark's eager versions on the CPU (the CUDA graph needs a GPU): losses and weights must agree."""
    data = tmp_path / "trees.txt"
    data.write_text("\n".join(generate_sst_lines(20, seed=3)) + "\n")
    rates = gpu_tree_lstm.main(["--quick", "--device", "cpu", "--data", str(data)])  # raises if losses differ
    assert set(rates) == {"hand-batched", "torchfold", "torchfold, plans built ahead", "static plans"}
    assert "the first 3 updates' losses and the weights after them agree" in capsys.readouterr().out


def test_schedules_script_quick(capsys: pytest.CaptureFixture[str]) -> None:
    results = schedules.main(["--quick"])
    assert "lower bound (longest chain)" in capsys.readouterr().out
    for counts in results.values():  # trees: one chain per depth, so depth batching is at the bound
        assert counts["depth batching"] == counts["lower bound"] == counts["agenda"]
        assert counts["batches at the bound"] == counts["batches"]


def test_schedule_counts_on_a_graph_where_depth_batching_is_above_the_bound() -> None:
    # a -> b -> c is the longest chain (3 calls); "d" reads a at depth 1 and "e" reads d at depth
    # 2 under depth batching, but "b" and "d" are different ops, so depth batching makes 5 groups
    # (a; b, d; c, e = 1 + 2 + 2), while the chain is 3 long: the bound is not reached.
    fold = torchfold.Fold()
    a = fold.add("a", 1)
    fold.add("c", fold.add("b", a))
    fold.add("e", fold.add("d", a))
    inputs, ops, depths = schedules.dependency_graph(fold)
    assert len(fold.groups()) == 5
    assert schedules.longest_chain(inputs) == 3
    assert schedules.agenda_calls(inputs, ops, depths) == 5
    assert sorted(depths.values()) == [0, 1, 1, 2, 2]


def test_markdown_table_aligns_columns() -> None:
    table = harness.markdown_table(["a", "bb"], [["x", 1.5], ["yyy", 1234.0]])
    lines = table.splitlines()
    assert lines[0] == "| a   | bb    |"
    assert lines[1] == "| --- | ----- |"
    assert lines[3] == "| yyy | 1,234 |"
    assert len({len(line) for line in lines}) == 1


def _write_trace(directory: Path, events: list[dict[str, Any]]) -> None:
    import gzip
    import json

    where = directory / "plugins" / "profile" / "run"
    where.mkdir(parents=True)
    with gzip.open(where / "host.trace.json.gz", "wt") as file:
        json.dump({"traceEvents": [{"ph": "X", "pid": 1, **event} for event in events]}, file)


def test_xla_profile_counts_executions_whose_operations_ran_before_the_wait(tmp_path: Path) -> None:
    """benchmarks/xla_profile.py's reading of a profiler trace, in the two layouts torch_xla's CPU
    backend writes: operations inside the wait for completion (they ran on the pool), and before
    it, the wait taking no time (they ran inline, as on a loaded machine). Only the first was
    counted, so a trace of inline executions "held no executed program" (the flaky smoke test)."""
    ex, wait = "ThunkExecutor::Execute", "ThunkExecutor::Execute (wait for completion)"
    _write_trace(
        tmp_path,
        [
            # on the pool: a short launch, then the operations while the caller waits
            {"name": ex, "tid": 7, "ts": 100, "dur": 5},
            {"name": wait, "tid": 7, "ts": 105, "dur": 1000},
            {"name": "dot.1", "tid": 8, "ts": 200, "dur": 400},
            {"name": "add_fusion.2", "tid": 8, "ts": 700, "dur": 100},
            # inline: the operations inside the launch, the wait empty at its end
            {"name": ex, "tid": 7, "ts": 5000, "dur": 1000},
            {"name": "dot.1", "tid": 7, "ts": 5100, "dur": 600},
            {"name": "add_fusion.2", "tid": 7, "ts": 5800, "dur": 100},
            {"name": wait, "tid": 7, "ts": 6000, "dur": 0},
        ],
    )
    times = xla_profile.step_times(tmp_path)
    assert times["steps"] == 2
    assert times["kinds"] == {"dot": 0.5, "add_fusion": 0.1}  # the medians of 0.4 and 0.6, of 0.1 and 0.1
    assert times["wall"] == pytest.approx((1.005 + 1.0) / 2)
    # the two executions as one step's programs (a replayed step: its minibatch and update programs)
    step = xla_profile.step_times(tmp_path, per_step=2)
    assert step["steps"] == 1
    assert step["kinds"] == pytest.approx({"dot": 1.0, "add_fusion": 0.2})
    assert step["wall"] == pytest.approx(1.005 + 1.0) and step["operations"] == pytest.approx(1.2)
    with pytest.raises(SystemExit, match="no executed program of a whole step"):
        xla_profile.step_times(tmp_path, per_step=3)


@pytest.mark.slow
def test_dynamo_follows_every_kind_of_read_the_probe_tries() -> None:
    """benchmarks/dynamo_guards.py: the reads a listed guard missed, each followed by Dynamo's guards."""
    assert {
        name: dynamo_guards.follows(*case) for name, case in dynamo_guards.CASES.items()
    } == dict.fromkeys(dynamo_guards.CASES, True)


def test_autobatch_tree_lstm_script_quick(capsys: pytest.CaptureFixture[str]) -> None:
    medians = autobatch_tree_lstm.main(["--quick"])  # checks equal losses and gradients first
    assert set(medians) == {"eager", "autobatch", "fold"}
    assert "autobatch / fold speed" in capsys.readouterr().out


def test_autobatch_parser_script_quick(capsys: pytest.CaptureFixture[str]) -> None:
    medians = autobatch_parser.main(["--quick"])  # checks equal losses, transitions and gradients first
    assert set(medians) == {"eager", "autobatch"}
    assert "sentences per batch" in capsys.readouterr().out


def test_autobatch_schedule_script_quick(capsys: pytest.CaptureFixture[str]) -> None:
    autobatch_schedule.main(["--quick"])  # checks autobatch's outputs against the fold's
    out = capsys.readouterr().out
    assert "autobatch (readiness)" not in out and "autobatch batched calls" in out and "bytes/node" in out


def test_coroutine_switch_times_each_mechanism(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coroutine_switch, "N", 2_000)
    assert coroutine_switch.greenlet_round_trip() > 0
    assert coroutine_switch.generator_round_trip() > 0
    assert coroutine_switch.thread_round_trip() > 0
