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
import contextlib
import functools
import gc
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
from tqdm import tqdm

from torchfold._deprecation import warn_renamed
from torchfold._validate import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    seed_int,
    thread_count,
)
from torchfold.engine.static.shapes import StaticShapes
from torchfold.examples.datasets import ENV_VAR, TreeParseError
from torchfold.train.capture.compiled import COMPILE_CHOICES, wants_compile
from torchfold.train.data.envelope import fit_static_shapes
from torchfold.train.data.loader import StepLoader
from torchfold.train.distributed.devices import capturable_optimizer, fused_optimizer
from torchfold.train.distributed.world import RunContext, default_device, init_distributed, run_context, world
from torchfold.train.loop.checkpoint import (
    CheckpointDirLock,
    HyperparameterMismatch,
)
from torchfold.train.loop.preemption import PREEMPTED_EXIT_CODE, Terminated, terminated_on_sigterm
from torchfold.train.loop.trainer import Preempted, StepStats, TraceTrainer
from torchfold.train.optim.optimizer import AccumulatingOptimizer
from torchfold.train.schedule.trace import BatchSizeTrace
from torchfold.train.task import BUILTIN_TASKS, Task, load_task, parse_task_args

__all__ = ["build_parser", "main"]

_PROG = "python -m torchfold train"
DEFAULT_MINIBATCH_SIZE = 25


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
    p.add_argument(
        "--data",
        metavar="DIR",
        help=f"sst task: directory with SST's train.txt (or an sst/ subdirectory); default ${ENV_VAR}; one of "
        "the two, or --generate, is required",
    )
    p.add_argument("--max-train", type=positive_int, help="sst task: use only the first N training trees")
    p.add_argument(
        "--max-words",
        type=positive_int,
        help="sst task: use only training trees of at most N words (before --max-train)",
    )
    p.add_argument(
        "--generate",
        type=positive_int,
        metavar="N",
        help="sst task, without --data or $" + ENV_VAR + ": train on N generated SST-like trees",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--minibatch-size",
        type=positive_int,
        help=f"trees per fold (default: the largest size up to {DEFAULT_MINIBATCH_SIZE} that divides every "
        "batch size of the trace)",
    )
    size.add_argument(
        "--max-device-batch-size",
        type=positive_int,
        metavar="N",
        help="elastic: instead of --minibatch-size, split each step's global batch into folds of at most N trees "
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
    p.add_argument("--no-eval", action="store_true", help="skip the task's evaluation after training")
    p.add_argument("--log-every", type=non_negative_int, default=10, help="steps between log lines (0: none)")
    p.add_argument("--history", metavar="FILE", help="write every step's stats as JSON lines (main rank)")
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
        choices=COMPILE_CHOICES,
        default="auto",
        help="capture each minibatch's forward, loss and backward once per static-shape layout and replay it: "
        "auto (default) on XLA and CUDA, on: also on the CPU, off: never",
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
        help="worker processes per rank that record and compile the folds (default 1; 0: in the training process)",
    )
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl on a CUDA --device, else gloo")
    p.add_argument(
        "--timeout", type=positive_float, default=60.0, help="seconds to wait for other ranks (default 60)"
    )
    return p


# The built-in sst task's options that this command also takes as flags (as before tasks had a name).
_SST_FLAGS = ("data", "max_train", "max_words", "generate", "embedding_dim", "hidden_dim")


def _sst_flags(args: argparse.Namespace) -> bool:
    """Whether the run names the sst task's options by this command's flags (no --task given)."""
    return args.task is None


def _task(args: argparse.Namespace) -> Task:
    """The task --task names, made with --task-arg (and, for the sst task, --data, --hidden-dim, ...)."""
    spec = args.task or "sst"
    task_args = parse_task_args(args.task_arg)
    given = {name: getattr(args, name) for name in _SST_FLAGS if getattr(args, name) is not None}
    if given and BUILTIN_TASKS.get(spec, spec) != BUILTIN_TASKS["sst"]:
        name = next(iter(given))
        raise ValueError(
            f"--{name.replace('_', '-')} is an option of the built-in sst task, and --task is {spec}; give that "
            f"task's own options as --task-arg KEY=VALUE (e.g. --task-arg {name}={given[name]})"
        )
    for name, value in given.items():
        if name in task_args:
            raise ValueError(
                f"--{name.replace('_', '-')} {value} and --task-arg {name}={task_args[name]} name the same option; "
                "give one"
            )
        task_args[name] = str(value)
    if BUILTIN_TASKS.get(spec, spec) == BUILTIN_TASKS["sst"] and "seed" not in task_args:
        task_args["seed"] = str(args.seed)  # the generated trees follow --seed, as they always did
    return load_task(spec, task_args)


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse --history and --checkpoint-dir paths of the wrong kind before any work is done."""
    if args.history is not None:
        history = Path(args.history)
        if history.is_dir():
            raise ValueError(f"--history {args.history} is a directory; give a file to write JSON lines to")
        if not history.parent.is_dir():
            raise ValueError(f"--history {args.history}: directory {history.parent} does not exist")
    if args.checkpoint_dir is not None:
        directory = Path(args.checkpoint_dir)
        if directory.exists() and not directory.is_dir():
            raise ValueError(
                f"--checkpoint-dir {args.checkpoint_dir} is a file; give a directory (created if missing)"
            )


def _lock_checkpoint_dir(args: argparse.Namespace, main_rank: bool) -> CheckpointDirLock | None:
    """Lock --checkpoint-dir on the main rank for the run; every rank raises if it is in use."""
    lock, problem = None, None
    if args.checkpoint_dir is not None and main_rank:
        try:
            lock = CheckpointDirLock(args.checkpoint_dir)
        except ValueError as e:
            problem = f"--checkpoint-dir {e}"
        except OSError as e:
            problem = f"--checkpoint-dir {args.checkpoint_dir}: cannot create it or its lock file ({e})"
    if args.checkpoint_dir is not None and dist.is_available() and dist.is_initialized():
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)  # the other ranks stop too, with rank 0's reason
        problem = shared[0]
    if problem is not None:
        raise ValueError(problem)
    if lock is not None and lock.removed:
        names = ", ".join(path.name for path in lock.removed)
        print(f"--checkpoint-dir: removed the temporary files of interrupted checkpoint writes: {names}")
    return lock


def _open_history(path: str, resumed_at: int | None) -> TextIO:
    """Open --history: afresh, or on resume keep the lines of the steps before ``resumed_at`` and append."""
    try:
        if resumed_at is None or not Path(path).is_file():
            return open(path, "w")
        kept = []
        with open(path) as old:
            for line in old:
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a crash
                if isinstance(step, int) and step < resumed_at:
                    kept.append(line if line.endswith("\n") else line + "\n")
        handle = open(path, "w")  # noqa: SIM115
        handle.writelines(kept)  # the steps the resumed run repeats are written again as it goes
        handle.flush()
        return handle
    except OSError as e:
        raise OSError(e.errno, f"--history {path}: cannot write it ({e.strerror or e})") from e


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
        print(
            "torchfold train: interrupted (Ctrl-C); the checkpoints written before it are kept: run the same "
            "command again to resume from the newest",
            file=sys.stderr,
        )
        return INTERRUPTED_EXIT_CODE
    except Terminated:
        print(
            "torchfold train: SIGTERM received outside a training step: stopped; the checkpoints written before "
            "it are kept: run the same command again to resume from the newest",
            file=sys.stderr,
        )
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
        trace = BatchSizeTrace.parse(args.trace)
        if args.minibatch_size is None and args.max_device_batch_size is None:
            args.minibatch_size = trace.largest_minibatch_size(DEFAULT_MINIBATCH_SIZE)
        elif args.minibatch_size is not None:
            try:
                trace.check_minibatch_size(args.minibatch_size)
            except ValueError as e:
                detail = str(e).replace("minibatch_size=", "--minibatch-size ")  # the trace module's word
                raise ValueError(f"--trace {args.trace}: {detail}") from e
        if trace.num_steps is None and args.max_steps is None and args.epochs is None:
            raise ValueError(
                f"--trace {args.trace} has no end (every step the same or a schedule without one): pass "
                "--max-steps N or --epochs N"
            )
        _check_paths(args)
        task = _task(args)
    except (ValueError, TypeError, FileNotFoundError, TreeParseError) as e:
        print(f"torchfold train: error: {_option_names(_task_arg_names(str(e), args))}", file=sys.stderr)
        return 2
    # The settings themselves (all small), so that a mismatch names the option and both values.
    config: dict[str, object] = {
        "trace batch sizes (fingerprint)": trace.fingerprint(),
        "training trees": len(task.train),
        **{
            f"--{k.replace('_', '-')}": v
            for k, v in vars(args).items()
            if k not in ("no_progress", "history")
        },
    }
    joined = False
    try:
        context = run_context(_device(args.device))
        joined = _init_distributed(args, config, context)
        return _train(args, trace, task, context)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"torchfold train: error: {_option_names(str(e))}", file=sys.stderr)
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


def _task_arg_names(message: str, args: argparse.Namespace) -> str:
    """The sst task's words for its options (``max_words=N``) as this run names them: ``--max-words N``
    when no --task is given, else ``--task-arg max_words=N``."""
    for name in sorted(_SST_FLAGS, key=len, reverse=True):
        flag = f"--{name.replace('_', '-')} " if _sst_flags(args) else f"--task-arg {name}="
        message = re.sub(rf"(?<![^ (])(?<!--task-arg ){name}=", flag, message)
    return message


def _option_names(message: str) -> str:
    """``message`` with the library's argument names the command line sets replaced by its options."""
    for argument, option in (
        ("the per-device maximum or max_accumulation_steps", "--max-device-batch-size or --max-accumulation"),
        ("max_accumulation_steps=", "--max-accumulation "),
        ("pass root=DIR", "pass --data DIR"),  # load_sst's advice on a missing data folder
    ):
        message = message.replace(argument, option)
    return message


def default_minibatch_size(trace: BatchSizeTrace, largest: int = DEFAULT_MINIBATCH_SIZE) -> int:
    """Deprecated: :meth:`BatchSizeTrace.largest_minibatch_size` (``trace.largest_minibatch_size(largest)``)."""
    warn_renamed(
        "torchfold.cli.train.default_minibatch_size(trace)", "BatchSizeTrace.largest_minibatch_size()"
    )
    return trace.largest_minibatch_size(largest)


def _stop_line(args: argparse.Namespace, trace: BatchSizeTrace, loader: StepLoader) -> str | None:
    """Why the run ends before the trace's last step, if it does (``None`` otherwise)."""
    sampler = loader.sampler
    if trace.num_steps is None:
        return None  # an unbounded trace: the run ends at --max-steps or --epochs, as asked
    total, trees = trace.num_steps, sampler.dataset_size
    epochs: int | None = args.epochs if args.epochs is not None else sampler.num_epochs
    if not epochs:
        return None
    end = trace.epoch(epochs - 1, trees, drop_last=sampler.drop_last).end_step
    if args.max_steps is not None and args.max_steps < end:
        return f"stops before step {args.max_steps} of the trace's {total} (--max-steps {args.max_steps})"
    if end >= total:
        return None
    if args.epochs is not None:
        return f"stops before step {end} of the trace's {total}: there epoch {epochs} ends (--epochs {args.epochs})"
    return (
        f"stops before step {end} of the trace's {total}: they hold {epochs} complete epoch(s) of {trees} "
        f"trees, and the last {total - end} step(s) would start one the trace cannot finish "
        f"(--epochs {epochs + 1} trains them too)"
    )


def _installed_version(distribution: str) -> str:
    """The installed version of ``distribution``, or ``"(version unknown)"``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _device(choice: str) -> torch.device:
    """The device ``--device`` names, by the library's rule (:func:`default_device`): ``auto`` is
    XLA when ``PJRT_DEVICE`` is set and torch_xla is installed, else CUDA, else the CPU; torch_xla
    is imported only for XLA."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available; use --device cpu or auto")
    try:
        return default_device(None if choice == "auto" else choice)
    except ImportError as e:
        if importlib.util.find_spec("torch_xla") is None:
            raise ValueError(
                "--device xla needs torch_xla: pip install 'pytorch-fold[xla]' (and set PJRT_DEVICE=TPU, or CPU to try it)"
            ) from e
        # Installed but broken: most often a torch_xla built for another torch (an undefined symbol).
        raise ValueError(
            f"--device {choice}: torch_xla {_installed_version('torch_xla')} is installed but fails to import "
            f"beside torch {torch.__version__} ({e}); install a matching pair: "
            "pip install 'pytorch-fold[xla]' (torch 2.9.0 with torch_xla 2.9.0)"
        ) from e


def _train(args: argparse.Namespace, trace: BatchSizeTrace, task: Task, context: RunContext) -> int:
    device = context.device
    static = context.static_shapes or wants_compile(args.compile, device)  # folds padded into static shapes
    if args.pack_levels and not static:
        raise ValueError(
            f"--pack-levels packs static shapes, and on {device.type} with --compile {args.compile} folds run "
            "unpadded; add --compile on (or train on XLA), or drop --pack-levels"
        )
    torch.manual_seed(args.seed)
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    if args.lr > torch.finfo(dtype).max:
        raise ValueError(
            f"--lr {args.lr} is beyond {args.dtype}'s range (at most {torch.finfo(dtype).max:.3g})"
        )
    model = _model(task).to(device=device, dtype=dtype)
    params = model.parameters()
    fused = fused_optimizer(device)  # one kernel for all parameters (CPU: 5x less time)
    base: torch.optim.Optimizer = (
        # on XLA, the step count stays on the device, so a captured update replays (--compile)
        torch.optim.Adam(params, lr=args.lr, fused=fused, capturable=capturable_optimizer(device))
        if args.optimizer == "adam"
        else torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, fused=fused)
    )
    optimizer = AccumulatingOptimizer(base, lr_rule=args.lr_rule, ref_batch_size=_ref_batch_size(args, trace))
    fold_trees = args.minibatch_size or args.max_device_batch_size
    build = task.build
    if static:
        # static shapes: what XLA needs to repeat its graphs, and what a captured step replays;
        # fitted to a pass over the data and frozen: the loader splits what does not fit, so none grows
        shapes = fit_static_shapes(
            task.train,
            task.build,
            fold_trees,
            shapes=StaticShapes(pack_levels=args.pack_levels),
            seed=args.seed,
        )
        build = functools.partial(task.build, shapes=shapes)
    loader = StepLoader(
        task.train,
        args.minibatch_size,
        build=build,
        trace=trace,
        seed=args.seed,
        drop_last=args.drop_last,
        num_workers=args.workers,
        max_device_batch_size=args.max_device_batch_size,
        max_accumulation_steps=args.max_accumulation,
    )
    history: list[TextIO] = []  # opened once the resume step is known (main rank)

    def record(stats: StepStats) -> None:
        for handle in history:
            try:
                handle.write(json.dumps(stats.__dict__) + "\n")
                handle.flush()  # a line per step, readable while the run goes on
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"--history {args.history}: cannot write step {stats.step}'s line ({e.strerror or e}); the run "
                    "stopped after that step",
                ) from e

    lock: CheckpointDirLock | None = None
    try:
        # before the trainer resumes from it or sets its checkpoints aside: one run per directory
        lock = _lock_checkpoint_dir(args, world().rank == 0)
        try:
            trainer = TraceTrainer(
                model,
                optimizer,
                loader,
                task.loss,
                device=context,
                checkpoint_dir=args.checkpoint_dir,
                checkpoint_every=args.checkpoint_every,
                keep_checkpoints=args.keep_checkpoints,
                log_every=args.log_every,
                progress=False if args.no_progress else None,
                on_step=record
                if args.history
                else None,  # (without: the host runs a step ahead on an accelerator)
                seed=args.seed,  # each fold's random draws: the same on any number of processes
                settings=_checkpoint_settings(args, trace, task),
                compile=args.compile,
                resume=not args.no_resume,  # the library's rule: resume, or set the old checkpoints aside
                override_hyperparameters=[
                    name for name in ("lr", "momentum") if getattr(args, f"override_{name}")
                ],
                log=tqdm.write,  # (stdout, the bar kept whole)
                num_threads=args.threads,  # None: the library's rule
            )
        except HyperparameterMismatch as e:
            raise _mismatch(e) from e
        main_rank = trainer.is_main
        if main_rank:
            print(
                f"task {task.name}: {task.description or f'{len(task.train)} samples'}; trace {trace.source!r} "
                f"({'unbounded' if trace.num_steps is None else f'{trace.num_steps} steps'}); "
                f"{loader.num_replicas} process(es), "
                + (
                    f"minibatch {args.minibatch_size}, "
                    if args.minibatch_size is not None
                    else f"at most {args.max_device_batch_size} samples per fold, "
                )
                + f"{args.workers} fold-building worker(s) each, device {device}"
            )
            stop = _stop_line(args, trace, loader)
            if stop is not None:
                print(f"run: {stop}")
        return _run(args, trainer, history, task)
    finally:
        loader.close()
        for handle in history:
            with contextlib.suppress(OSError):  # a failed write was reported already; keep that error
                handle.close()
        if lock is not None:
            lock.release()


def _run(args: argparse.Namespace, trainer: TraceTrainer, history: list[TextIO], task: Task) -> int:
    """Open --history (after the trainer resumed, or not), train; the caller closes what this opens."""
    main_rank = trainer.is_main
    resumed = trainer.resumed_from  # (resumed, or set the checkpoints aside, when it was made: it said which)
    if resumed is not None and main_rank:
        for name, (saved, value) in trainer.overridden.items():
            print(f"--override-{name}: training on with --{name} {value} instead of the checkpoint's {saved}")
    if args.history and main_rank:
        history.append(_open_history(args.history, trainer.next_step if resumed is not None else None))
    # The parsed trees live as long as the run: out of the cyclic GC's full collections (and,
    # forked into the workers, out of their copy-on-write pages). Undone at the end (main() may
    # run inside a bigger process), unless something else had frozen objects before.
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        steps = trainer.fit(max_steps=args.max_steps, epochs=args.epochs)
    finally:
        if freeze:
            gc.unfreeze()
    if main_rank:
        samples = sum(s.batch_size for s in steps)
        seconds = sum(s.seconds for s in steps)
        final = f"; loss {steps[-1].loss:.4f} (mean over the last step)" if steps else ""
        print(
            f"done: {len(steps)} steps ({samples} samples, {samples / max(seconds, 1e-9):.1f} samples/s) up to "
            f"step {trainer.next_step}{final}"
        )
        if task.evaluate is not None and not args.no_eval:
            print(f"eval: {_evaluate(task, trainer.model)}")
    return 0


def _evaluate(task: Task, model: torch.nn.Module) -> str:
    """The task's evaluation of ``model`` on its eval samples, as one line."""
    assert task.evaluate is not None
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            metrics = task.evaluate(model, task.eval)
    finally:
        model.train(training)
    shown = ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())
    return f"{shown} ({len(task.eval)} held-out samples of task {task.name})"


def _model(task: Task) -> torch.nn.Module:
    """The task's model, checked: a module (the message names the task's factory)."""
    try:
        model = task.model()
    except TypeError as e:
        raise TypeError(
            f"task {task.name}: model() failed: {e}; model must be callable with no argument, e.g. "
            "functools.partial(MyModel, hidden_dim)"
        ) from e
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"task {task.name}: model() returned a {type(model).__name__}, not a torch.nn.Module; make it return "
            "the module whose methods are the fold's ops"
        )
    return model


def _checkpoint_settings(args: argparse.Namespace, trace: BatchSizeTrace, task: Task) -> dict[str, object]:
    """The options a checkpoint is only valid with (the model, the data, the split), by their names."""
    settings: dict[str, object] = {
        "--trace (batch sizes fingerprint)": trace.fingerprint(),
        "training trees": len(task.train),
        "--task": BUILTIN_TASKS.get(args.task or "sst", args.task or "sst"),
    }
    for name, value in task.settings.items():  # the task's own: its model's sizes, its vocabulary
        flag = (
            f"--{name.replace('_', '-')}"
            if _sst_flags(args) and name in _SST_FLAGS
            else f"task {task.name}'s {name}"
        )
        settings[flag] = value
    for name in ("dtype", "minibatch_size", "max_device_batch_size", "seed"):
        settings[f"--{name.replace('_', '-')}"] = getattr(args, name)
    # The optimizer's and the sampler's states refuse these too, in the library's words (lr_rule=...):
    # checked here first, a mismatch names the option. (Checkpoints written before they were
    # settings lack them; the library's check still refuses a mismatch there.)
    settings["--lr-rule"] = args.lr_rule
    settings["--ref-batch-size"] = _ref_batch_size(args, trace)  # the one the run uses, default included
    settings["--drop-last"] = args.drop_last
    return settings


def _ref_batch_size(args: argparse.Namespace, trace: BatchSizeTrace) -> int | None:
    """The optimizer's reference batch size: --ref-batch-size, else the trace's first; none for the constant rule."""
    if args.lr_rule == "constant":
        return None
    return args.ref_batch_size if args.ref_batch_size is not None else trace[0]


def _mismatch(e: HyperparameterMismatch) -> ValueError:
    """A checkpoint of another optimizer, --lr or --momentum, in the command line's words."""
    if e.name == "optimizer":
        fix = f"resume with --optimizer {e.saved}, or start afresh (--no-resume or another --checkpoint-dir)"
    else:
        fix = f"resume with --{e.name} {e.saved}, or add --override-{e.name} to train on with --{e.name} {e.value}"
    return ValueError(
        f"{e.source} was written with --{e.name} {e.saved}, this run has --{e.name} {e.value}; {fix}"
    )
