"""A differential fuzzer of XLA steps: random losses and schedules, XLA against the eager CPU.

Each scenario (a seed) draws an optimizer (SGD, SGD with momentum, Adam, AdamW), learning rates
and weight decays that collide with other scalars of the step (0.1, 0.01, 0.001, ``1 - beta1``),
one or two param groups, a frozen parameter or none, an LR scheduler stepped in ``on_step`` or
none (``StepLR``, ``LambdaLR``, or ``OneCycleLR``, which cycles the momentum or Adam's betas too),
a trace of 1-5 minibatches per step, a loss that is a function or an ``nn.Module`` with a weight
of its own, an op that rebinds a running statistic kept as a plain tensor attribute at every
call (or none), a loss term switched on by Python's ``random`` (or none), and changes that
``on_step`` makes at random steps to what the loss reads: a module attribute, a closure
variable, a global, a tensor kept as a plain attribute (in place or anew), a buffer, a numpy
scalar, a class attribute, a global and an attribute first set after the trainer was made, an
activation function kept in an attribute, an attribute two objects down
(``model.cfg.loss.weight``), the module loss's weight. ``on_step`` also sets an attribute no step
reads (``model.global_step``). With ``--compile replay`` (the opt-in replay) only the reads its
contract covers change (the others are replayed stale, as its warning says), and dropout is
drawn too: the CPU's and XLA's random numbers differ, so a replay must refuse it.

The scenario trains a small Tree-LSTM on SST trees with :class:`~torchfold.train.TraceTrainer`
twice: eagerly on the CPU (``compile="off"``) and on XLA (``compile=`` as ``--compile`` says;
``auto``, the default, runs the step's Python at every step). Every step's loss, the final
parameters and the optimizer state must agree within float tolerance, or the XLA run must have
refused with its warning (``steps are not replayed``); anything else is a *silent difference*,
the defect this hunts.

Usage (the XLA environment, torch_xla's CPU backend)::

    PJRT_DEVICE=CPU .venv-xla/bin/python scripts/fuzz_replay.py --data tests/data --seeds 0:25
    PJRT_DEVICE=CPU .venv-xla/bin/python scripts/fuzz_replay.py --data ../shared/data --seeds 0:200 --chunk 25
    PJRT_DEVICE=CPU .venv-xla/bin/python scripts/fuzz_replay.py --data tests/data --seeds 0:25 --compile replay

``--chunk`` runs that many scenarios per fresh process (torch_xla has crashed in a process that
had run very many programs). The last line counts the scenarios: ``N passed, N failed``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

#: a global the scenario's loss reads: changed by ``on_step``
GLOBAL_SCALE = 1.0
# LATE_SCALE: a global the loss reads that is first assigned after the trainer was made (run())

NUM_TREES = 30
MINIBATCH = 3


@dataclass
class Scenario:
    """One random training run's settings (see the module)."""

    seed: int
    optimizer: str
    lr: float
    weight_decay: float
    groups: int
    frozen: bool
    dropout: bool
    schedule: str
    trace: list[int]
    #: the loss is an ``nn.Module`` with a weight of its own (else a function)
    module_loss: bool = False
    #: the loss rebinds a running statistic kept as a plain tensor attribute at every call
    running_stat: bool = False
    #: a loss term switched on by Python's ``random``
    random_term: bool = False
    #: (after step, what, value): ``on_step`` makes these changes before the next step
    changes: list[tuple[int, str, float]] = field(default_factory=list)


def draw(seed: int, replicas: int = 1, compile: str = "auto") -> Scenario:
    """The scenario of ``seed`` (for ``replicas`` XLA replicas, which take no global changes:
    the scenario's initial model is made in the parent process). With ``compile="replay"``, only
    the reads its contract covers (:data:`~torchfold.train.capture.mechanism.REPLAY_CONTRACT`:
    the values its guard lists, tensors) are changed, and no loss is a module, rebinds a
    statistic or draws from ``random``: the others are replayed stale, as its warning says; dropout
    is drawn only there, where its verdict is decidable (a refusal)."""
    within_contract = compile == "replay"
    rng = random.Random(seed)
    collide = [0.1, 0.01, 0.001, 1 - 0.9, 0.05]
    optimizer = rng.choice(["sgd", "momentum", "adam", "adamw"])
    # whole epochs of steps of 1-5 minibatches (the loader ends a step at its epoch's end)
    trace: list[int] = []
    for _ in range(rng.randint(2, 3)):
        left = NUM_TREES
        while left:
            size = min(left, MINIBATCH * rng.randint(1, 5))
            trace.append(size)
            left -= size
    steps = len(trace)
    module_loss = rng.random() < 0.3
    kinds = [
        "attribute",
        "closure",
        "global",
        "tensor attribute",
        "buffer",
        "tensor replaced",
        "numpy scalar",
        "class attribute",
        "late global",
        "late attribute",
        "swapped function",
        "deep attribute",
    ]
    if within_contract:
        kinds = kinds[:6]
    elif module_loss:
        kinds.append("module loss weight")
    if replicas > 1:
        kinds = [kind for kind in kinds if "global" not in kind]
    changes = []
    for _ in range(rng.randint(0, 5)):
        changes.append(
            (rng.randrange(steps - 1), rng.choice(kinds), rng.choice([0.5, 1.0, 2.0, 0.1, 0.01, 3.0]))
        )
    return Scenario(
        seed=seed,
        optimizer=optimizer,
        lr=rng.choice(collide) if optimizer != "sgd" else rng.choice([0.1, 0.05, 0.01]),
        weight_decay=rng.choice([0.0, 0.0, 0.01, 0.1, 0.001]),
        groups=rng.choice([1, 2]),
        frozen=rng.random() < 0.3,
        dropout=rng.random() < 0.15 and within_contract,
        schedule=rng.choice(["none", "none", "steplr", "lambda", "onecycle"]),
        trace=trace,
        changes=sorted(changes),
        module_loss=module_loss and not within_contract,
        running_stat=rng.random() < 0.3 and not within_contract,
        random_term=rng.random() < 0.3 and not within_contract,
    )


class _Model(torch.nn.Module):
    """The example Tree-LSTM with what the loss reads beside its parameters."""

    #: a class attribute the loss reads (``self.cls_scale``): changed on the class by ``on_step``
    cls_scale = 1.0

    def __init__(self, vocab: int, dropout: bool) -> None:
        super().__init__()
        from torchfold.examples.models import TreeLSTM

        self.tree = TreeLSTM(vocab, 6, 6)
        self.drop = torch.nn.Dropout(0.5) if dropout else torch.nn.Identity()
        self.alpha = 1.0  # a Python number the loss reads
        self.np_scale = np.float64(1.0)  # a numpy scalar the loss reads
        self.act = torch.tanh  # a function the loss calls, swapped by on_step
        self.cfg = SimpleNamespace(loss=SimpleNamespace(weight=1.0))  # read two objects down
        self.register_buffer("offset", torch.zeros(()))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.tree, name)  # the fold ops are the Tree-LSTM's


class _ModuleLoss(torch.nn.Module):
    """A loss written as a module, with a weight of its own (``on_step`` changes it)."""

    def __init__(self, loss: Any) -> None:
        super().__init__()
        self.loss = loss
        self.weight = 1.0

    def forward(self, m: Any, outputs: Any, targets: Any) -> torch.Tensor:
        result: torch.Tensor = self.loss(m, outputs, targets) * self.weight
        return result


def _make_loss(model: _Model, scenario: Scenario) -> tuple[Any, Any]:
    from torchfold.examples.models import tree_lstm_loss

    weight = 1.0  # a closure variable the loss reads
    reads_numpy = any(kind == "numpy scalar" for _, kind, _ in scenario.changes)

    def loss(m: Any, outputs: Any, targets: Any) -> torch.Tensor:
        base = tree_lstm_loss(m.tree, [m.drop(o) for o in outputs], targets)
        head = m.tree.classifier.weight
        penalty = sum((p**2).sum() for p in m.tree.classifier.parameters())
        scale = weight * m.alpha * GLOBAL_SCALE * LATE_SCALE * m.temperature
        if reads_numpy:  # (read only where it changes: under compile='on' a graph reading it runs lazily)
            scale = scale * float(m.np_scale)
        total = base * scale * m.cls_scale * m.cfg.loss.weight + 0.01 * penalty + (m.scale * m.offset).sum()
        total = total + 0.01 * m.act(head).sum()
        if scenario.running_stat:  # a running statistic, rebound at every call
            m.center = 0.5 * m.center + 0.5 * head.detach().mean(0)
            total = total + 0.1 * ((head - m.center) ** 2).sum()
        if scenario.random_term and random.random() < 0.5:  # a term switched on by Python's random
            total = total + 0.05 * penalty
        return total

    def set_weight(value: float) -> None:
        nonlocal weight
        weight = value

    return (_ModuleLoss(loss) if scenario.module_loss else loss), set_weight


def run(
    scenario: Scenario,
    device: torch.device,
    data: Path,
    *,
    replicas: int = 1,
    rank: int = 0,
    initial: Any = None,
    compile: str = "auto",
) -> dict[str, Any]:
    """Train ``scenario`` on ``device`` (as replica ``rank`` of ``replicas``, from a copy of the
    model ``initial``, with ``compile=`` on XLA); its losses, parameters, optimizer state and warnings."""
    global GLOBAL_SCALE, LATE_SCALE
    from torchfold.engine.static.shapes import StaticShapes
    from torchfold.examples.datasets import Vocab, load_sst
    from torchfold.examples.models import TreeLSTMBuild
    from torchfold.train import AccumulatingOptimizer, StepLoader, TraceTrainer, fit_static_shapes

    GLOBAL_SCALE = 1.0
    globals().pop("LATE_SCALE", None)  # assigned after the trainer is made
    _Model.cls_scale = 1.0
    trees = load_sst(data, max_trees=NUM_TREES)
    vocab = Vocab.build(trees)
    xla = device.type == "xla"
    # one layout, on both devices: a minibatch that does not fit it is split in two, and the loss's
    # Python (a running statistic, a random term) then runs once more; the CPU splits it the same way
    shapes = fit_static_shapes(
        trees, TreeLSTMBuild(vocab), MINIBATCH, shapes=StaticShapes(depth_buckets=False)
    )
    model = (initial_model(scenario, data) if initial is None else copy.deepcopy(initial)).to(device)
    model.scale = torch.ones(2, dtype=torch.float64, device=device)  # a tensor kept as a plain attribute
    if scenario.running_stat:
        model.center = torch.zeros(6, dtype=torch.float64, device=device)
    if scenario.frozen:
        model.tree.embedding.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    groups: list[dict[str, Any]]
    if scenario.groups == 2:
        head = {id(p) for p in model.tree.classifier.parameters()}
        groups = [
            {"params": [p for p in params if id(p) not in head]},
            {"params": [p for p in params if id(p) in head], "lr": scenario.lr * 2},
        ]
    else:
        groups = [{"params": params}]
    wd = scenario.weight_decay
    base: torch.optim.Optimizer
    if scenario.optimizer == "sgd":
        base = torch.optim.SGD(groups, lr=scenario.lr, weight_decay=wd)
    elif scenario.optimizer == "momentum":
        base = torch.optim.SGD(groups, lr=scenario.lr, momentum=0.9, weight_decay=wd)
    elif scenario.optimizer == "adam":
        base = torch.optim.Adam(groups, lr=scenario.lr, eps=1e-3, weight_decay=wd, capturable=xla)
    else:
        base = torch.optim.AdamW(groups, lr=scenario.lr, eps=1e-3, weight_decay=wd or 0.01, capturable=xla)
    optimizer = AccumulatingOptimizer(base, lr_rule="linear", ref_batch_size=MINIBATCH)
    loader = StepLoader(
        trees,
        MINIBATCH,
        num_replicas=replicas,
        rank=rank,
        build=TreeLSTMBuild(vocab, shapes=shapes),
        trace=scenario.trace,
        seed=0,
        num_workers=0,
    )
    loss, set_weight = _make_loss(model, scenario)
    scheduler: Any = None
    if scenario.schedule == "steplr":
        scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=2, gamma=0.5)
    elif scenario.schedule == "lambda":
        scheduler = torch.optim.lr_scheduler.LambdaLR(base, lambda step: 1.0 / (1 + step))
    elif scenario.schedule == "onecycle":  # cycles the momentum (SGD) or beta1 (Adam) too
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            base, max_lr=[2 * group["lr"] for group in base.param_groups], total_steps=len(scenario.trace) + 1
        )

    compiled_by_step: list[int] = []

    def on_step(stats: Any) -> None:
        global GLOBAL_SCALE, LATE_SCALE
        if xla:
            compiled_by_step.append(_compilations())
        model.global_step = stats.step  # an attribute no step reads
        if scheduler is not None:
            scheduler.step()
        for after, what, value in scenario.changes:
            if after != stats.step:
                continue
            if what == "attribute":
                model.alpha = value
            elif what == "closure":
                set_weight(value)
            elif what == "global":
                GLOBAL_SCALE = value
            elif what == "tensor attribute":
                model.scale.fill_(value)
            elif what == "buffer":
                model.offset.fill_(value)
            elif what == "numpy scalar":
                model.np_scale = np.float64(value)
            elif what == "class attribute":
                _Model.cls_scale = value
            elif what == "late global":
                LATE_SCALE = value
            elif what == "late attribute":
                model.temperature = value
            elif what == "swapped function":
                model.act = torch.relu if model.act is torch.tanh else torch.tanh
            elif what == "deep attribute":
                model.cfg.loss.weight = value
            elif what == "module loss weight":
                loss.weight = value
            else:  # a new tensor in the attribute's place
                model.scale = torch.full((2,), value, dtype=torch.float64, device=device)

    trainer = TraceTrainer(
        model, optimizer, loader, loss, progress=False, on_step=on_step, compile=compile if xla else "off"
    )
    # first set after the trainer (and whatever it keeps of the step) was made
    LATE_SCALE = 1.0
    model.temperature = 1.0
    random.seed(scenario.seed)  # (the draws of the loss's random term, the same on both devices)
    compiled_before = _compilations() if xla else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.fit(max_steps=len(scenario.trace))
    state = [
        value.detach().cpu().double()
        for entry in base.state.values()
        for _, value in sorted(entry.items())
        if isinstance(value, torch.Tensor)
    ]
    return {
        "losses": [s.loss for s in history],
        "params": [p.detach().cpu() for p in model.parameters()],
        "state": state,
        "warnings": [str(w.message) for w in caught],
        "captures": trainer.runner.captures,
        # XLA programs compiled in this run (torch_xla's count; one per process, replicas share it)
        "compilations": _compilations() - compiled_before if xla else 0,
        # per step (after its update): the programs compiled in it
        "compiled_by_step": [
            now - then
            for now, then in zip(compiled_by_step, [compiled_before, *compiled_by_step], strict=False)
        ],
        # (read from the runner: warnings.catch_warnings is not thread-safe, and replicas may be threads)
        "refused": getattr(getattr(trainer.runner, "programs", None), "refused", None),
    }


def _compilations() -> int:
    """XLA programs compiled so far in this process (torch_xla's own count)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def initial_model(scenario: Scenario, data: Path) -> _Model:
    """The scenario's model before training, on the CPU (float64)."""
    from torchfold.examples.datasets import Vocab, load_sst

    vocab = Vocab.build(load_sst(data, max_trees=NUM_TREES))
    torch.manual_seed(scenario.seed)
    return _Model(len(vocab), scenario.dropout).to(dtype=torch.float64)


def _replica(index: int, seed: int, data: str, out: str, initial: Any, compile: str) -> None:
    """One of several XLA replicas (``xmp.spawn``): train the scenario of ``seed``, rank 0 saves."""
    import torch_xla
    import torch_xla.runtime as xr

    torch.set_default_dtype(torch.float64)
    scenario = draw(seed, xr.world_size(), compile)
    result = run(
        scenario,
        torch_xla.device(),
        Path(data),
        replicas=xr.world_size(),
        rank=xr.global_ordinal(),
        initial=initial,
        compile=compile,
    )
    if xr.global_ordinal() == 0:
        torch.save(result, out)


def run_replicas(seed: int, data: Path, replicas: int, compile: str = "auto") -> dict[str, Any]:
    """The XLA side of ``seed`` on ``replicas`` CPU devices, in a fresh process (torch_xla's
    devices are fixed when its runtime starts)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.pt"
        command = [
            sys.executable,
            __file__,
            "--data",
            str(data),
            "--replica-child",
            str(seed),
            "--out",
            str(out),
            "--compile",
            compile,
        ]
        env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(replicas)}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not out.exists():
            return {
                "losses": [],
                "params": [],
                "state": [],
                "warnings": [],
                "captures": 0,
                "error": done.stderr[-3000:],
            }
        result: dict[str, Any] = torch.load(out, weights_only=False)
        return result


def compare(scenario: Scenario, cpu: dict[str, Any], xla: dict[str, Any]) -> tuple[str, str]:
    """``("equal" | "refused" | "SILENT", details)``: the XLA run agrees with the CPU's, or was
    refused with its warning, or neither."""
    refused = [w for w in xla["warnings"] if "not replayed" in w]
    if not refused and xla.get("refused"):
        refused = [f"steps are not replayed: {xla['refused']}"]
    problems = []
    if len(cpu["losses"]) != len(scenario.trace):
        problems.append(f"the CPU ran {len(cpu['losses'])} steps of {len(scenario.trace)}")
    if len(cpu["losses"]) != len(xla["losses"]):
        problems.append(f"{len(xla['losses'])} steps against {len(cpu['losses'])}")
    for step, (a, b) in enumerate(zip(cpu["losses"], xla["losses"], strict=False)):
        if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-8):
            problems.append(f"step {step}: loss {b!r} against the CPU's {a!r}")
            break
    for name in ("params", "state"):
        if len(cpu[name]) != len(xla[name]):
            problems.append(f"{len(xla[name])} {name} tensors against {len(cpu[name])}")
            continue
        for number, (a, b) in enumerate(zip(cpu[name], xla[name], strict=True)):
            if a.shape != b.shape or not torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-7):
                gap = float((a.double() - b.double()).abs().max()) if a.shape == b.shape else math.inf
                problems.append(f"{name} {number} differs by {gap:.3g}")
                break
    if scenario.dropout:  # random numbers: the CPU's and XLA's draws differ; replays must be refused
        return ("refused", refused[0]) if refused else ("SILENT", "dropout replayed without a refusal")
    if not problems:
        captured = f"{xla['captures']} programs captured, {xla.get('compilations', 0)} compiled"
        # (compile='on' on XLA: a step TorchDynamo cannot capture whole runs its Python lazily instead)
        lazily = [w for w in xla["warnings"] if "not through torch.compile" in w]
        if lazily:
            captured += f"; ran its Python instead: {lazily[0].partition('one graph: ')[2][:160]}"
        return "equal", captured + (f"; refused: {refused[0]}" if refused else "")
    if refused:
        return "refused", f"{refused[0]} ({'; '.join(problems)})"
    return "SILENT", "; ".join(problems)


def _seeds(text: str) -> list[int]:
    first, _, last = text.partition(":")
    return list(range(int(first), int(last))) if last else [int(first)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True, help="a folder with sst/train.txt")
    parser.add_argument("--seeds", default="0:25", help="FIRST:END (END excluded), or one seed")
    parser.add_argument(
        "--chunk", type=int, default=0, help="scenarios per fresh process (0: all in this one)"
    )
    parser.add_argument("--json", type=Path, help="append one JSON line per scenario here")
    parser.add_argument("--replicas", type=int, default=1, help="XLA replicas (CPU devices) per scenario")
    parser.add_argument(
        "--cache",
        type=Path,
        help="a folder for XLA's persistent compilation cache, shared by the scenarios and chunks (faster reruns)",
    )
    parser.add_argument(
        "--compile",
        default="auto",
        help="the XLA run's compile= (auto: the default mechanism; on: torch.compile, TorchDynamo's guards; "
        "replay: the opt-in replay)",
    )
    parser.add_argument("--replica-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replica_child is not None:  # a fresh process of run_replicas: the replicas themselves
        import torch_xla.distributed.xla_multiprocessing as xmp

        torch.set_default_dtype(torch.float64)
        initial = initial_model(draw(args.replica_child, 2, args.compile), args.data)
        xmp.spawn(_replica, args=(args.replica_child, str(args.data), str(args.out), initial, args.compile))
        return 0
    seeds = _seeds(args.seeds)
    if args.replicas > 1:
        return _main_replicas(args, seeds)
    if args.chunk:
        failed = 0
        for start in range(0, len(seeds), args.chunk):
            part = seeds[start : start + args.chunk]
            command = [
                sys.executable,
                __file__,
                "--data",
                str(args.data),
                "--seeds",
                f"{part[0]}:{part[-1] + 1}",
                "--compile",
                args.compile,
            ]
            if args.json:
                command += ["--json", str(args.json)]
            if args.cache:
                command += ["--cache", str(args.cache)]
            failed |= subprocess.run(command, env={**os.environ, "PJRT_DEVICE": "CPU"}).returncode
        return 1 if failed else 0
    import torch_xla

    if args.cache is not None:
        import torch_xla.runtime as xr

        xr.initialize_cache(str(args.cache), readonly=False)
    device = torch_xla.device()  # (before any backward on the CPU: autograd counts the devices at its first)
    # float64 throughout, Adam's step counts included: a capturable Adam's bias corrections are
    # computed in its step count's dtype, and 1 - 0.999**step in float32 differs from the CPU's
    # Python float by up to 1e-5 relative (a difference of precision, not of replay)
    torch.set_default_dtype(torch.float64)
    counts = {"equal": 0, "refused": 0, "SILENT": 0}
    for seed in seeds:
        scenario = draw(seed, compile=args.compile)
        cpu = run(scenario, torch.device("cpu"), args.data)
        xla = run(scenario, device, args.data, compile=args.compile)
        verdict, details = compare(scenario, cpu, xla)
        counts[verdict] += 1
        print(f"seed {seed}: {verdict}: {details}  [{scenario}]", flush=True)
        if args.json:
            with args.json.open("a") as out:
                out.write(
                    json.dumps({"seed": seed, "verdict": verdict, "details": details, **asdict(scenario)})
                    + "\n"
                )
    print(
        f"equal {counts['equal']}, refused with a warning {counts['refused']}, silent differences {counts['SILENT']}"
    )
    print(f"{counts['equal'] + counts['refused']} passed, {counts['SILENT']} failed")
    return 1 if counts["SILENT"] else 0


def _main_replicas(args: argparse.Namespace, seeds: list[int]) -> int:
    """Each scenario on ``args.replicas`` XLA replicas (a fresh process each) against one CPU process."""
    torch.set_default_dtype(torch.float64)
    counts = {"equal": 0, "refused": 0, "SILENT": 0}
    for seed in seeds:
        scenario = draw(seed, args.replicas, args.compile)
        cpu = run(scenario, torch.device("cpu"), args.data)
        xla = run_replicas(seed, args.data, args.replicas, args.compile)
        verdict, details = compare(scenario, cpu, xla)
        if "error" in xla:
            verdict, details = "SILENT", f"the replicas failed: {xla['error']}"
        counts[verdict] += 1
        print(f"seed {seed} on {args.replicas} replicas: {verdict}: {details}  [{scenario}]", flush=True)
        if args.json:
            with args.json.open("a") as out:
                line = {"seed": seed, "replicas": args.replicas, "verdict": verdict, "details": details}
                out.write(json.dumps({**line, **asdict(scenario)}) + "\n")
    print(
        f"equal {counts['equal']}, refused with a warning {counts['refused']}, silent differences {counts['SILENT']}"
    )
    print(f"{counts['equal'] + counts['refused']} passed, {counts['SILENT']} failed")
    return 1 if counts["SILENT"] else 0


if __name__ == "__main__":
    sys.exit(main())
