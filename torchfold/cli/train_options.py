"""What ``python -m torchfold train``'s options make (the trace, the task, the device, the checkpoint
settings), and its messages in their words: the command's wording, beside :mod:`torchfold.cli.train`
(which parses, calls the library and prints).

The sst task's options are also this command's flags (``--data``, ``--hidden-dim``, ...: :data:`SST_FLAGS`),
as before tasks had a name; the library's messages name them as the run does.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchfold._deprecation import warn_renamed
from torchfold._validate import positive_int
from torchfold.examples.datasets import ENV_VAR
from torchfold.train.data.loader import StepLoader
from torchfold.train.data.sampler import TraceMismatch
from torchfold.train.distributed.world import default_device
from torchfold.train.loop.arguments import fit_end
from torchfold.train.loop.checkpoint import HyperparameterMismatch
from torchfold.train.loop.stats import StepStats
from torchfold.train.schedule.trace import BatchSizeTrace
from torchfold.train.task import BUILTIN_TASKS, Task, load_task, parse_task_args

__all__ = [
    "DEFAULT_MINIBATCH_SIZE",
    "INTERRUPTED_LINE",
    "SST_FLAGS",
    "TERMINATED_LINE",
    "add_sst_data_flags",
    "banner_lines",
    "checkpoint_settings",
    "default_minibatch_size",
    "device_from_flag",
    "done_line",
    "dtype_from_flags",
    "evaluation_flags",
    "evaluation_line",
    "handshake_settings",
    "loader_flags",
    "mismatch_error",
    "option_names",
    "ref_batch_size",
    "stop_line",
    "task_arg_names",
    "task_from_flags",
    "trace_from_flags",
    "trace_mismatch_error",
    "trainer_flags",
]

#: the largest default --minibatch-size (the largest size up to it that divides every batch size)
DEFAULT_MINIBATCH_SIZE = 25

#: what the command says when Ctrl-C stops it
INTERRUPTED_LINE = (
    "interrupted (Ctrl-C); the checkpoints written before it are kept: run the same command again to resume "
    "from the newest"
)
#: what the command says when SIGTERM stops it outside a step (in a step: the trainer's Preempted)
TERMINATED_LINE = (
    "SIGTERM received outside a training step: stopped; the checkpoints written before it are kept: run the "
    "same command again to resume from the newest"
)

#: The built-in sst task's options that the command also takes as flags (as before tasks had a name).
SST_FLAGS = ("data", "max_train", "max_words", "generate", "embedding_dim", "hidden_dim")


def add_sst_data_flags(parser: argparse.ArgumentParser) -> None:
    """The sst task's data options as flags of ``parser`` (--data, --max-train, --max-words, --generate)."""
    parser.add_argument(
        "--data",
        metavar="DIR",
        help=f"sst task: directory with SST's train.txt (or an sst/ subdirectory); default ${ENV_VAR}; one of "
        "the two, or --generate, is required",
    )
    parser.add_argument(
        "--max-train", type=positive_int, help="sst task: use only the first N training trees"
    )
    parser.add_argument(
        "--max-words",
        type=positive_int,
        help="sst task: use only training trees of at most N words (before --max-train)",
    )
    parser.add_argument(
        "--generate",
        type=positive_int,
        metavar="N",
        help="sst task, without --data or $" + ENV_VAR + ": train on N generated SST-like trees",
    )


def _sst_flags(args: argparse.Namespace) -> bool:
    """Whether the run names the sst task's options by the command's flags (no --task given)."""
    return args.task is None


def trace_from_flags(args: argparse.Namespace) -> BatchSizeTrace:
    """The trace --trace names, checked against --minibatch-size (set to its default here when no
    size is given) and, for a trace without an end, --max-steps and --epochs."""
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
    return trace


def task_from_flags(args: argparse.Namespace) -> Task:
    """The task --task names, made with --task-arg (and, for the sst task, --data, --hidden-dim, ...)."""
    spec = args.task or "sst"
    task_args = parse_task_args(args.task_arg)
    given = {name: getattr(args, name) for name in SST_FLAGS if getattr(args, name) is not None}
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


def dtype_from_flags(args: argparse.Namespace) -> torch.dtype:
    """The parameters' dtype --dtype names, checked to hold --lr."""
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    if args.lr > torch.finfo(dtype).max:
        raise ValueError(
            f"--lr {args.lr} is beyond {args.dtype}'s range (at most {torch.finfo(dtype).max:.3g})"
        )
    return dtype


def loader_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~torchfold.train.StepLoader` arguments that flags set one for one."""
    return {
        "seed": args.seed,
        "drop_last": args.drop_last,
        "num_workers": args.workers,
        "max_device_batch_size": args.max_device_batch_size,
        "max_accumulation_steps": args.max_accumulation,
    }


def trainer_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~torchfold.train.TraceTrainer` arguments that flags set one for one."""
    return {
        "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every": args.checkpoint_every,
        "keep_checkpoints": args.keep_checkpoints,
        "log_every": args.log_every,
        "progress": False if args.no_progress else None,
        "seed": args.seed,  # each fold's random draws: the same on any number of processes
        "resume": not args.no_resume,  # the library's rule: resume, or set the old checkpoints aside
        "override_hyperparameters": [n for n in ("lr", "momentum") if getattr(args, f"override_{n}")],
        "num_threads": args.threads,  # None: the library's rule
        "precision": args.precision,
        "max_grad_norm": args.max_grad_norm,
    }


def evaluation_flags(args: argparse.Namespace, task: Task) -> dict[str, Any]:
    """The :class:`~torchfold.train.TraceTrainer` arguments of --eval-every: the task's evaluation,
    its held-out samples and the period (none without the flag; a ValueError for a task without one)."""
    if args.eval_every is None:
        return {}
    if task.evaluate is None:
        raise ValueError(
            f"--eval-every {args.eval_every}: task {task.name} has no evaluation (its Task has no evaluate= and "
            "eval=); give it one, or drop --eval-every"
        )
    return {"evaluate": task.evaluate, "eval_data": task.eval, "eval_every": args.eval_every}


def handshake_settings(args: argparse.Namespace, trace: BatchSizeTrace, task: Task) -> dict[str, object]:
    """What all ranks must agree on before joining (all small): a mismatch names the option and both values."""
    return {
        "trace batch sizes (fingerprint)": trace.fingerprint(),
        "training samples": len(task.train),
        **{
            f"--{k.replace('_', '-')}": v
            for k, v in vars(args).items()
            if k not in ("no_progress", "history")
        },
    }


def task_arg_names(message: str, args: argparse.Namespace) -> str:
    """The sst task's words for its options (``max_words=N``) as this run names them: ``--max-words N``
    when no --task is given, else ``--task-arg max_words=N``."""
    for name in sorted(SST_FLAGS, key=len, reverse=True):
        flag = f"--{name.replace('_', '-')} " if _sst_flags(args) else f"--task-arg {name}="
        message = re.sub(rf"(?<![^ (])(?<!--task-arg ){name}=", flag, message)
    return message


def option_names(message: str, args: argparse.Namespace | None = None) -> str:
    """``message`` with the library's argument names the command line sets replaced by its options
    (with ``args``, the sst task's too: :func:`task_arg_names`)."""
    if args is not None:
        message = task_arg_names(message, args)
    message = re.sub(r"precision='(\w+)'", r"--precision \1", message)  # check_precision's words
    for argument, option in (
        ("the per-device maximum or max_accumulation_steps", "--max-device-batch-size or --max-accumulation"),
        ("max_accumulation_steps=", "--max-accumulation "),
        ("pass root=DIR", "pass --data DIR"),  # load_sst's advice on a missing data folder
    ):
        message = message.replace(argument, option)
    return message


def stop_line(
    args: argparse.Namespace, trace: BatchSizeTrace, loader: StepLoader[Any, Any], next_step: int
) -> str | None:
    """Why the run ends before the trace's last step, if it does (``None`` otherwise): the bound
    :meth:`TraceTrainer.fit <torchfold.train.TraceTrainer.fit>` stops at (``fit_end``), worded in flags."""
    sampler = loader.sampler
    epochs: int | None = args.epochs if args.epochs is not None else sampler.num_epochs
    if trace.num_steps is None or not epochs:
        return None  # an unbounded trace ends at --max-steps or --epochs, as asked; a short one at its end
    total, samples = trace.num_steps, sampler.dataset_size
    end, _ = fit_end(loader, next_step, args.max_steps, args.epochs)
    if end >= total:
        return None
    if args.max_steps is not None and end == args.max_steps:
        return f"stops before step {end} of the trace's {total} (--max-steps {args.max_steps})"
    if args.epochs is not None:
        return f"stops before step {end} of the trace's {total}: there epoch {epochs} ends (--epochs {args.epochs})"
    return (
        f"stops before step {end} of the trace's {total}: they hold {epochs} complete epoch(s) of {samples} "
        f"samples, and the last {total - end} step(s) would start one the trace cannot finish "
        f"(--epochs {epochs + 1} trains them too)"
    )


def banner_lines(
    args: argparse.Namespace,
    trace: BatchSizeTrace,
    task: Task,
    loader: StepLoader[Any, Any],
    device: torch.device,
    next_step: int = 0,
) -> list[str]:
    """What the main rank says before the first step: the task, the trace, the processes, and where the
    run stops before the trace's end (:func:`stop_line`)."""
    line = (
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
    stop = stop_line(args, trace, loader, next_step)
    return [line] if stop is None else [line, f"run: {stop}"]


def done_line(steps: Sequence[StepStats], next_step: int) -> str:
    """The line that ends a run: its steps, samples and speed, and the last step's loss."""
    samples = sum(s.batch_size for s in steps)
    seconds = sum(s.seconds for s in steps)
    final = f"; loss {steps[-1].loss:.4f} (mean over the last step)" if steps else ""
    return (
        f"done: {len(steps)} steps ({samples} samples, {samples / max(seconds, 1e-9):.1f} samples/s) up to "
        f"step {next_step}{final}"
    )


def evaluation_line(task: Task, model: torch.nn.Module, metrics: Mapping[str, float] | None = None) -> str:
    """The task's evaluation of ``model`` on its eval samples (or its ``metrics``, evaluated already), as one line."""
    found = task.evaluate_model(model) if metrics is None else metrics
    shown = ", ".join(f"{name} {value:.4f}" for name, value in found.items())
    return f"{shown} ({len(task.eval)} held-out samples of task {task.name})"


def default_minibatch_size(trace: BatchSizeTrace, largest: int = DEFAULT_MINIBATCH_SIZE) -> int:
    """Deprecated: :meth:`BatchSizeTrace.largest_minibatch_size` (``trace.largest_minibatch_size(largest)``)."""
    warn_renamed(
        "torchfold.cli.train.default_minibatch_size(trace)", "BatchSizeTrace.largest_minibatch_size()"
    )
    return trace.largest_minibatch_size(largest)


def _installed_version(distribution: str) -> str:
    """The installed version of ``distribution``, or ``"(version unknown)"``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def device_from_flag(choice: str) -> torch.device:
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


def checkpoint_settings(args: argparse.Namespace, trace: BatchSizeTrace, task: Task) -> dict[str, object]:
    """The options a checkpoint is only valid with (the model, the data, the split), by their names."""
    # (not --trace: the loader's state holds the steps taken, and a --trace that begins with them, a
    # longer one too, trains on; trace_mismatch_error words a refusal)
    settings: dict[str, object] = {
        "training samples": len(task.train),
        "--task": BUILTIN_TASKS.get(args.task or "sst", args.task or "sst"),
    }
    for name, value in task.settings.items():  # the task's own: its model's sizes, its vocabulary
        flag = (
            f"--{name.replace('_', '-')}"
            if _sst_flags(args) and name in SST_FLAGS
            else f"task {task.name}'s {name}"
        )
        settings[flag] = value
    for name in ("dtype", "minibatch_size", "max_device_batch_size", "seed"):
        settings[f"--{name.replace('_', '-')}"] = getattr(args, name)
    # The optimizer's and the sampler's states refuse these too, in the library's words (lr_rule=...):
    # checked here first, a mismatch names the option. (Checkpoints written before they were
    # settings lack them; the library's check still refuses a mismatch there.)
    settings["--lr-rule"] = args.lr_rule
    settings["--ref-batch-size"] = ref_batch_size(args, trace)  # the one the run uses, default included
    settings["--drop-last"] = args.drop_last
    return settings


def ref_batch_size(args: argparse.Namespace, trace: BatchSizeTrace) -> int | None:
    """The optimizer's reference batch size: --ref-batch-size, else the trace's first; none for the constant rule."""
    if args.lr_rule == "constant":
        return None
    return args.ref_batch_size if args.ref_batch_size is not None else trace[0]


def trace_mismatch_error(e: TraceMismatch, args: argparse.Namespace) -> ValueError:
    """A checkpoint that took other steps than --trace's first ones, in the command line's words."""
    differs = (
        f"--trace {args.trace} has only {e.step} steps"
        if e.here is None
        else f"its step {e.step} had batch size {e.saved}, and --trace {args.trace} has {e.here} there"
    )
    return ValueError(
        f"{e.source} has taken {e.taken} steps of another trace: {differs}; resume with a --trace whose first "
        f"{e.taken} steps are the checkpoint's (it may go on longer), or start afresh (--no-resume or another "
        "--checkpoint-dir)"
    )


def mismatch_error(e: HyperparameterMismatch) -> ValueError:
    """A checkpoint of another optimizer, --lr or --momentum, in the command line's words."""
    if e.name == "optimizer":
        fix = f"resume with --optimizer {e.saved}, or start afresh (--no-resume or another --checkpoint-dir)"
    else:
        fix = f"resume with --{e.name} {e.saved}, or add --override-{e.name} to train on with --{e.name} {e.value}"
    return ValueError(
        f"{e.source} was written with --{e.name} {e.saved}, this run has --{e.name} {e.value}; {fix}"
    )
