"""Command line: ``python -m torchfold train``, a task (by default a Tree-LSTM on SST) with a batch size that follows a trace.

``--task`` names what to train: a built-in task (``sst``, ``pyast``) or any importable
``package.module:function`` returning a :class:`~torchfold.train.Task`, with ``--task-arg KEY=VALUE``
for its options; everything else (trace, learning-rate rule, devices, processes, checkpoints) is
this command's.

Runs as one process, or as one of several under ``torchrun --nproc_per_node=K`` (gloo on CPU,
nccl on CUDA): the process group is created from torchrun's environment with a timeout, after a
handshake in which all ranks check that they agree on the trace and the settings. With
``--checkpoint-dir`` the run writes checkpoints and, started again with the same arguments,
resumes from the newest one exactly, also with another number of processes. SIGTERM stops it
after the current step with a checkpoint and exit status 75 (:data:`PREEMPTED_EXIT_CODE`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from torchfold._validate import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    seed_int,
    thread_count,
)
from torchfold.cli.train_options import (
    DEFAULT_MINIBATCH_SIZE,
    INTERRUPTED_LINE,
    TERMINATED_LINE,
    add_sst_data_flags,
    banner_lines,
    checkpoint_settings,
    device_from_flag,
    done_line,
    dtype_from_flags,
    evaluation_flags,
    evaluation_line,
    handshake_settings,
    loader_flags,
    mismatch_error,
    option_names,
    ref_batch_size,
    task_from_flags,
    trace_from_flags,
    trace_mismatch_error,
    trainer_flags,
)
from torchfold.cli.train_options import default_minibatch_size as default_minibatch_size  # deprecated
from torchfold.cli.train_run import StepHistory, check_paths, frozen_gc, lock_checkpoint_dir
from torchfold.examples.datasets import TreeParseError
from torchfold.train.capture import StepMechanism
from torchfold.train.data.envelope import fit_static_shapes
from torchfold.train.data.loader import StepLoader
from torchfold.train.data.sampler import TraceMismatch
from torchfold.train.distributed.world import RunContext, init_distributed, run_context, world
from torchfold.train.loop.checkpoint import CheckpointDirLock, HyperparameterMismatch
from torchfold.train.loop.preemption import PREEMPTED_EXIT_CODE, Terminated, terminated_on_sigterm
from torchfold.train.loop.tensorboard import TensorBoardWriter
from torchfold.train.loop.trainer import Preempted, TraceTrainer
from torchfold.train.optim.optimizer import AccumulatingOptimizer
from torchfold.train.optim.precision import PRECISIONS, autocast
from torchfold.train.schedule.trace import BatchSizeTrace
from torchfold.train.task import BUILTIN_TASKS, Task

__all__ = ["build_parser", "main"]

_PROG = "python -m torchfold train"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m torchfold train``."""
    p = argparse.ArgumentParser(
        prog=_PROG,
        description="Train a task (default: a binary Tree-LSTM on SST trees) with one Fold per minibatch, the "
        "global batch size following a trace, gradients accumulated and all-reduced once per step (run under "
        "torchrun --nproc_per_node=K for K processes). Built-in tasks: "
        + "; ".join(f"{name} ({spec})" for name, spec in BUILTIN_TASKS.items())
        + ".",
    )
    p.add_argument(
        "--task",
        metavar="SPEC",
        help=f"what to train: a built-in task ({', '.join(BUILTIN_TASKS)}; default sst) or "
        "package.module:function returning a torchfold.train.Task",
    )
    p.add_argument(
        "--task-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an argument of the task's function, e.g. --task-arg hidden_dim=32 (repeat for more)",
    )
    p.add_argument(
        "--trace",
        required=True,
        help="global batch size per step: a step,batchsize CSV file, an int (constant), a list such as "
        "32,64,96, or a schedule such as linear:32:256:1000 (see python -m torchfold trace --help); the "
        "trace= of StepLoader takes the same strings",
    )
    add_sst_data_flags(p)  # (the sst task's options, also flags of this command)
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--minibatch-size",
        type=positive_int,
        help=f"samples per fold (default: the largest size up to {DEFAULT_MINIBATCH_SIZE} that divides every "
        "batch size of the trace)",
    )
    size.add_argument(
        "--max-device-batch-size",
        type=positive_int,
        metavar="N",
        help="elastic: instead of --minibatch-size, split each step's global batch into folds of at most N samples "
        "over the processes present (the accumulation follows the process count)",
    )
    p.add_argument(
        "--max-accumulation",
        type=positive_int,
        metavar="K",
        help="with --max-device-batch-size: refuse a trace that needs more than K folds per process in a step",
    )
    p.add_argument("--epochs", type=positive_int, help="epochs (default: all the trace covers)")
    p.add_argument("--max-steps", type=non_negative_int, help="stop before this global step")
    p.add_argument("--drop-last", action="store_true", help="leave out an epoch's final partial step")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="default adam")
    p.add_argument("--lr", type=positive_float, default=0.005, help="reference learning rate (default 0.005)")
    p.add_argument("--momentum", type=non_negative_float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument(
        "--lr-rule",
        choices=("constant", "linear", "sqrt", "adascale"),
        default="constant",
        help="how the learning rate follows the global batch (default constant)",
    )
    p.add_argument(
        "--ref-batch-size",
        type=positive_int,
        help="batch size --lr was tuned for (default: the trace's first batch size)",
    )
    p.add_argument("--embedding-dim", type=positive_int, help="sst task: word embedding size (default 64)")
    p.add_argument("--hidden-dim", type=positive_int, help="sst task: Tree-LSTM state size (default 64)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="default float32")
    p.add_argument("--seed", type=seed_int, default=0, help="initialisation and shuffling seed (default 0)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints here, resume from the newest")
    p.add_argument(
        "--checkpoint-every",
        type=non_negative_int,
        default=0,
        help="steps between checkpoints (0: at the end)",
    )
    p.add_argument("--keep-checkpoints", type=positive_int, default=2, help="newest ones to keep (default 2)")
    p.add_argument(
        "--no-resume",
        action="store_true",
        help="start afresh even if checkpoints exist (they are moved to a subdirectory of --checkpoint-dir, "
        "earlier-N/, so that this run's are the ones a later resume continues)",
    )
    p.add_argument(
        "--override-lr",
        action="store_true",
        help="on resume, train on with this --lr instead of the checkpoint's (else a different --lr is an error)",
    )
    p.add_argument(
        "--override-momentum",
        action="store_true",
        help="on resume, train on with this --momentum instead of the checkpoint's (SGD)",
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32 (default); bf16: each minibatch's forward and loss under autocast to bfloat16 (any device); "
        "fp16: float16 with loss scaling (CUDA only); the parameters and the update keep --dtype",
    )
    p.add_argument(
        "--max-grad-norm",
        type=positive_float,
        metavar="NORM",
        help="clip each step's gradient (the mean over its global batch) to this total 2-norm before the update",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write the log lines' numbers and the evaluations as TensorBoard scalars to DIR (created if missing; "
        "needs the tensorboard extra; main rank)",
    )
    p.add_argument(
        "--eval-every",
        type=positive_int,
        metavar="N",
        help="evaluate the task on its held-out samples after every N steps (logged, in --history and "
        "--tensorboard); the task needs an evaluation",
    )
    p.add_argument("--no-eval", action="store_true", help="skip the task's evaluation after training")
    p.add_argument("--log-every", type=non_negative_int, default=10, help="steps between log lines (0: none)")
    p.add_argument(
        "--history",
        metavar="FILE",
        help="write every step's stats as JSON lines (main rank; its folder made if missing)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--threads",
        type=thread_count,
        help="CPU threads per process (default: the library's rule, 1 unless OMP_NUM_THREADS is set; at most 4 "
        "per CPU of the machine)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda", "xla"),
        default="auto",
        help="auto (default): XLA when PJRT_DEVICE is set and torch_xla is installed, else CUDA if present, "
        "else the CPU; on XLA, folds are padded into static shapes fitted to the first minibatches",
    )
    p.add_argument(
        "--compile",
        choices=StepMechanism.compile_choices,
        default="auto",
        help="auto (default): run every step's Python (on XLA lazily: XLA compiles a program per graph and reuses "
        "it); on: torch.compile (on XLA a program captured from each graph, replayed while TorchDynamo's guards "
        "hold; the step's Python run lazily where TorchDynamo cannot capture it whole); replay (XLA and CUDA, opt-in): capture each step once per "
        "static-shape layout and replay it without running its Python (for a step that reads nothing but its "
        "inputs: its warning says the contract); off: eager",
    )
    p.add_argument(
        "--pack-levels",
        action="store_true",
        help="with static shapes (XLA, --compile): run tree nodes later than their depth where the envelope has "
        "room, for less padding at more host time per fold",
    )
    p.add_argument(
        "--workers",
        type=non_negative_int,
        default=1,
        help="worker processes per rank that record and plan the folds (default 1; 0: in the training process)",
    )
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl on a CUDA --device, else gloo")
    p.add_argument(
        "--timeout", type=positive_float, default=60.0, help="seconds to wait for other ranks (default 60)"
    )
    return p


def _init_distributed(args: argparse.Namespace, config: dict[str, object], context: RunContext) -> bool:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); True if we did."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    init_distributed(args.backend or context.backend, timeout=args.timeout, config=config)
    return True


# What a shell reports for a process stopped by Ctrl-C (128 + SIGINT).
INTERRUPTED_EXIT_CODE = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m torchfold train`` with arguments ``argv``; returns the exit status.

    Ctrl-C (``KeyboardInterrupt``) ends it with one line and :data:`INTERRUPTED_EXIT_CODE`; the
    worker processes are stopped and the checkpoints written before it are kept. SIGTERM during
    a step finishes it and writes a checkpoint (:class:`~torchfold.train.loop.trainer.Preempted`); at
    any other time it stops the run where it stands (:class:`Terminated`); both end with one line
    and :data:`~torchfold.train.loop.preemption.PREEMPTED_EXIT_CODE`.
    """
    try:
        with terminated_on_sigterm():
            return _main(argv)
    except KeyboardInterrupt:
        print(f"torchfold train: {INTERRUPTED_LINE}", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except Terminated:
        print(f"torchfold train: {TERMINATED_LINE}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.max_device_batch_size is None and args.max_accumulation is not None:
        parser.print_usage(sys.stderr)
        print(f"{_PROG}: error: --max-accumulation needs --max-device-batch-size", file=sys.stderr)
        return 2
    try:
        trace = trace_from_flags(args)  # (--minibatch-size's default set)
        check_paths(args)
        task = task_from_flags(args)
    except (ValueError, TypeError, FileNotFoundError, TreeParseError) as e:
        print(f"torchfold train: error: {option_names(str(e), args)}", file=sys.stderr)
        return 2
    joined = False
    try:
        context = run_context(device_from_flag(args.device))
        joined = _init_distributed(args, handshake_settings(args, trace, task), context)
        return _train(args, trace, task, context)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"torchfold train: error: {option_names(str(e))}", file=sys.stderr)
        return 2
    except Preempted as e:
        print(f"torchfold train: {e}", file=sys.stderr)
        return e.exit_code
    except (RuntimeError, TimeoutError, FloatingPointError, OSError) as e:
        print(f"torchfold train: error: {e}", file=sys.stderr)
        return 1
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()


def _train(args: argparse.Namespace, trace: BatchSizeTrace, task: Task, context: RunContext) -> int:
    device = context.device
    if task.forward is not None and args.compile in ("on", "replay"):
        raise ValueError(
            f"--compile {args.compile} captures each step's static-shape plans, and task {task.name!r} gives a "
            "per-sample forward (batched by autobatch as it runs: no plan to capture); drop --compile "
            "(the default, auto, runs it eagerly) or write the task with build and loss"
        )
    mechanism = StepMechanism(device, compile=args.compile)  # how steps run: static shapes, the optimizer
    if args.pack_levels and not mechanism.needs_static_shapes:
        raise ValueError(
            f"--pack-levels packs static shapes, and on {device.type} with --compile {args.compile} folds run "
            "unpadded; add --compile on (or train on XLA), or drop --pack-levels"
        )
    torch.manual_seed(args.seed)
    dtype = dtype_from_flags(args)
    model = task.make_model().to(device=device, dtype=dtype)
    momentum = {"momentum": args.momentum} if args.optimizer == "sgd" else {}
    optimizer_class = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    base = mechanism.optimizer(optimizer_class, model.parameters(), lr=args.lr, **momentum)
    optimizer = AccumulatingOptimizer(base, lr_rule=args.lr_rule, ref_batch_size=ref_batch_size(args, trace))
    build = task.build
    if mechanism.needs_static_shapes and task.forward is None:  # fitted to a pass over the data and frozen
        fold_samples = args.minibatch_size or args.max_device_batch_size
        shapes = mechanism.static_shapes(pack_levels=args.pack_levels)
        shapes = fit_static_shapes(task.train, task.build, fold_samples, shapes=shapes, seed=args.seed)
        build = functools.partial(task.build, shapes=shapes)
    loader = StepLoader(task.train, args.minibatch_size, build=build, trace=trace, **loader_flags(args))
    history = StepHistory(args.history)  # opened once the resume step is known (main rank)
    evaluation = evaluation_flags(args, task)
    lock: CheckpointDirLock | None = None
    writer: TensorBoardWriter | None = None
    try:
        if args.tensorboard is not None and world().rank == 0:  # (the trainer reports on the main rank)
            writer = tensorboard_writer(args.tensorboard)
        # before the trainer resumes from it or sets its checkpoints aside: one run per directory
        lock = lock_checkpoint_dir(args, world().rank == 0)
        try:
            trainer = TraceTrainer(
                model,
                optimizer,
                loader,
                task.loss,
                device=context,  # (the trainer asks this run's context, not a second one)
                compile=mechanism,  # (decided once: the folds' padding, the optimizer, the runner)
                on_step=history.record if args.history else None,  # (without: a step ahead on an accelerator)
                settings=checkpoint_settings(args, trace, task),
                log=tqdm.write,  # (stdout, the bar kept whole)
                on_metrics=() if writer is None else writer,
                **trainer_flags(args),
                **evaluation,
            )
        except HyperparameterMismatch as e:
            raise mismatch_error(e) from e
        except TraceMismatch as e:
            raise trace_mismatch_error(e, args) from e
        if trainer.is_main:
            print("\n".join(banner_lines(args, trace, task, loader, device, trainer.next_step)))
        return _run(args, trainer, history, task)
    finally:
        loader.close()
        history.close()
        if writer is not None:
            writer.close()
        if lock is not None:
            lock.release()


def _run(args: argparse.Namespace, trainer: TraceTrainer, history: StepHistory, task: Task) -> int:
    """Open --history (after the trainer resumed, or not), train; the caller closes what this opens."""
    main_rank = trainer.is_main
    resumed = trainer.resumed_from  # (resumed, or set the checkpoints aside, when it was made: it said which)
    if resumed is not None and main_rank:
        for name, (saved, value) in trainer.overridden.items():
            print(f"--override-{name}: training on with --{name} {value} instead of the checkpoint's {saved}")
    if args.history and main_rank:
        history.open(trainer.next_step if resumed is not None else None)
    with frozen_gc():  # (the loaded samples live as long as the run)
        steps = trainer.fit(max_steps=args.max_steps, epochs=args.epochs)
    if main_rank:
        print(done_line(steps, trainer.next_step))
        if task.evaluate is not None and not args.no_eval:
            if steps and steps[-1].metrics:  # (--eval-every evaluated the last step)
                line = evaluation_line(task, trainer.model, steps[-1].metrics)
            else:
                with autocast(
                    trainer.precision, trainer.device
                ):  # (as the steps ran and --eval-every evaluates)
                    line = evaluation_line(task, trainer.model)
            print(f"eval: {line}")
    return 0


def tensorboard_writer(log_dir: str) -> TensorBoardWriter:
    """--tensorboard's writer; a missing tensorboard package is a ValueError naming the flag and the extra."""
    try:
        return TensorBoardWriter(log_dir)
    except ImportError as e:
        raise ValueError(f"--tensorboard {log_dir}: {e}") from e
