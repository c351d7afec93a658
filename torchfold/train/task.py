"""A task: what a training run needs from its user, and how a command line names one.

A :class:`Task` holds the data (training and evaluation samples), the half of the loss that
records a minibatch on a fold (``build``), the model factory, the half of the loss that runs on
the fold's outputs (``loss``) and, optionally, an evaluation. Everything else (the batch-size
trace, the learning-rate rule, devices, processes, static shapes, checkpoints and resuming)
belongs to the run: ``python -m torchfold train --task package.module:make_task`` trains any task
that way, as does a loop of your own.

:func:`load_task` turns a spec (a built-in name from :data:`BUILTIN_TASKS`, or
``package.module:function``) and ``KEY=VALUE`` arguments into a task: the function is called with
the arguments converted to the types its signature declares. Its errors name the command line's
flags (``--task``, ``--task-arg``), the value and the fix.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchfold.train.persample import SampleLoss, build_samples

__all__ = ["BUILTIN_TASKS", "Task", "load_task", "parse_task_args"]

#: The tasks that ship with torchfold: name -> ``module:function`` spec.
BUILTIN_TASKS: dict[str, str] = {
    "sst": "torchfold.examples.tasks:sst_task",
    "pyast": "torchfold.examples.tasks:pyast_task",
}


@dataclass(frozen=True)
class Task:
    """What a training run needs from its user: data, a fold per minibatch, a model and a loss.

    Args:
        name: a short name for log lines, e.g. ``"sst"``.
        train: the training samples (indexable, with ``len()``: a list).
        build: ``build(samples, shapes=None) -> (plan, targets)``: records ``samples`` on a
            ``torchfold.Fold(shapes=shapes)`` and returns its plan (``fold.plan(...)``) and the
            targets the loss needs, padded with ``plan.pad`` where they have a row per node
            (padded rows then weigh 0). The run passes ``shapes`` on XLA and with ``--compile``;
            without, ``shapes`` is ``None``. It runs in loader worker processes: a module-level
            function or an instance of a module-level class, holding no tensor on a device.
        model: ``model() -> nn.Module``, on the CPU; the run moves it to its device and dtype.
            The module's methods are the fold's ops.
        loss: ``loss(model, outputs, targets) -> scalar tensor``, ``outputs`` being
            ``plan.apply(model, padded=True)`` and ``targets`` what ``build`` returned (numpy
            arrays arrive as they were; turn them into tensors on ``outputs``' device). The
            loss of a minibatch must be its mean over samples, so that minibatches of a step
            combine into the step's loss.
        eval: samples to evaluate on (default none).
        evaluate: ``evaluate(model, samples) -> {"metric": value}`` on ``eval`` (default none),
            run after training under ``torch.no_grad()``, the model in ``eval()`` mode.
        description: one line saying where the data came from, for the run's banner.
        settings: what a checkpoint is only valid with (model sizes, vocabulary size, ...): a
            resume with other values is refused, naming them.
        forward: instead of ``build`` and ``loss``: ``forward(model, sample) -> scalar loss``,
            plain PyTorch for one sample. The run batches each minibatch's samples with
            :func:`torchfold.autobatch` and takes the mean of their losses, so a step equals one
            big batch as with ``build``. Give either ``forward`` or ``build`` and ``loss``.

    Example:
        >>> import torch, torchfold
        >>> from torch import nn
        >>> class Doubler(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(1))
        ...     def double(self, x):
        ...         return x * self.w * 2
        >>> def build(samples, shapes=None):
        ...     fold = torchfold.Fold(shapes=shapes)
        ...     nodes = [fold.add("double", torch.tensor([[float(s)]])) for s in samples]
        ...     plan = fold.plan([nodes])
        ...     # a row per node of request 0 (the list given to fold.plan): padded like the plan
        ...     wanted = plan.pad(request=0, values=[[2.0 * s] for s in samples])
        ...     weights = plan.pad(request=0, values=[1 / len(samples)] * len(samples))  # padded rows: 0
        ...     return plan, (wanted, weights)
        >>> def loss(model, outputs, targets):
        ...     wanted, weights = targets
        ...     return (((outputs[0] - wanted) ** 2).squeeze(1) * weights).sum()
        >>> task = Task("double", train=[1, 2, 3], build=build, model=Doubler, loss=loss)
        >>> model = task.model()
        >>> for shapes in (None, torchfold.StaticShapes()):  # padded (XLA, compiled runs) or not
        ...     plan, targets = task.build(task.train, shapes=shapes)
        ...     print(task.loss(model, plan.apply(model, padded=True), targets).item())
        0.0
        0.0
    """

    name: str
    train: Sequence[Any]
    # None only until __post_init__, which fills build and loss from forward, or refuses the task
    build: Callable[..., tuple[Any, Any]] = None  # type: ignore[assignment]
    model: Callable[[], nn.Module] = None  # type: ignore[assignment]
    loss: Callable[[nn.Module, Sequence[Any], Any], torch.Tensor] = None  # type: ignore[assignment]
    eval: Sequence[Any] = ()
    evaluate: Callable[[nn.Module, Sequence[Any]], Mapping[str, float]] | None = None
    description: str = ""
    settings: Mapping[str, object] = field(default_factory=dict)
    forward: Callable[[nn.Module, Any], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Task(name=...) must be a non-empty str, got {self.name!r}")
        for name in ("train", "eval"):
            value = getattr(self, name)
            if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
                raise TypeError(
                    f"Task {self.name!r}: {name} must be a sequence of samples (a list), got "
                    f"{type(value).__name__}; wrap an iterable in list(...)"
                )
        if len(self.train) == 0:
            raise ValueError(f"Task {self.name!r}: train holds no samples; give it the training samples")
        if self.forward is not None:
            if self.build is not None or self.loss is not None:
                given = " and ".join(n for n in ("build", "loss") if getattr(self, n) is not None)
                raise TypeError(
                    f"Task {self.name!r}: forward is given with {given}; give either forward(model, sample) -> loss "
                    "(per-sample, batched by torchfold.autobatch) or build and loss (a fold), not both"
                )
            if not callable(self.forward):
                raise TypeError(
                    f"Task {self.name!r}: forward must be callable, got {type(self.forward).__name__}"
                )
            # the run reads build and loss: a per-sample forward is those two, batched by autobatch
            object.__setattr__(self, "build", build_samples)
            object.__setattr__(self, "loss", SampleLoss(self.forward))
        elif self.build is None and self.loss is None:
            raise TypeError(
                f"Task {self.name!r}: neither forward nor build and loss are given; give forward(model, sample) -> "
                "loss (plain per-sample PyTorch), or build(samples, shapes=None) and loss(model, outputs, targets)"
            )
        for name in ("build", "model", "loss"):
            if not callable(getattr(self, name)):
                raise TypeError(
                    f"Task {self.name!r}: {name} must be callable, got {type(getattr(self, name)).__name__}"
                )
        try:
            parameters = inspect.signature(self.build).parameters
        except (TypeError, ValueError):  # no signature to read: trust it
            parameters = None
        if (
            parameters is not None
            and "shapes" not in parameters
            and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        ):
            raise TypeError(
                f"Task {self.name!r}: build takes no shapes argument; write it as build(samples, shapes=None) and "
                "record on torchfold.Fold(shapes=shapes) (runs on XLA and with --compile pass a StaticShapes)"
            )
        if self.evaluate is not None and not callable(self.evaluate):
            raise TypeError(
                f"Task {self.name!r}: evaluate must be callable or None, got {type(self.evaluate).__name__}"
            )
        if self.evaluate is not None and len(self.eval) == 0:
            raise ValueError(f"Task {self.name!r}: evaluate is set but eval holds no samples; give it some")
        if not isinstance(self.settings, Mapping):
            raise TypeError(
                f"Task {self.name!r}: settings must be a mapping, got {type(self.settings).__name__}"
            )

    def make_model(self) -> nn.Module:
        """``model()``, checked: a :class:`torch.nn.Module`, else an error naming the task and the fix."""
        try:
            model = self.model()
        except TypeError as e:
            raise TypeError(
                f"task {self.name}: model() failed: {e}; model must be callable with no argument, e.g. "
                "functools.partial(MyModel, hidden_dim)"
            ) from e
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"task {self.name}: model() returned a {type(model).__name__}, not a torch.nn.Module; make it "
                "return the module whose methods are the fold's ops"
            )
        return model

    def evaluate_model(self, model: nn.Module) -> Mapping[str, float]:
        """``evaluate(model, eval)`` in ``model.eval()`` and :func:`torch.no_grad`; the model goes back
        to the mode it was in. A ValueError where the task has no ``evaluate``."""
        if self.evaluate is None:
            raise ValueError(f"task {self.name} has no evaluate; give Task(..., evaluate=..., eval=...)")
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return self.evaluate(model, self.eval)
        finally:
            model.train(training)


def parse_task_args(items: Sequence[str]) -> dict[str, str]:
    """``["k=v", ...]`` (each ``--task-arg``) as a dict; a key given twice or an item without ``=`` is refused.

    >>> parse_task_args(["hidden_dim=32", "data=/tmp/x=y"])
    {'hidden_dim': '32', 'data': '/tmp/x=y'}
    """
    found: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise ValueError(f"--task-arg {item}: expected KEY=VALUE, e.g. --task-arg hidden_dim=32")
        if key in found:
            raise ValueError(f"--task-arg {key} is given twice ({found[key]!r} and {value!r}); give it once")
        found[key] = value
    return found


def _resolve(spec: str) -> tuple[str, Callable[..., Any]]:
    """The factory a spec names: a built-in name or ``package.module:function``; with its full spec."""
    full = BUILTIN_TASKS.get(spec, spec)
    module_name, sep, attr = full.partition(":")
    builtins = ", ".join(sorted(BUILTIN_TASKS))
    if not sep or not module_name or not attr:
        raise ValueError(
            f"--task {spec}: not a built-in task ({builtins}) nor MODULE:FUNCTION; "
            "give e.g. --task mypackage.tasks:make_task (a function returning a torchfold.train.Task)"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            e.add_note(f"while importing {module_name} for --task {spec}")
            raise  # the task's module exists but imports something missing: its own error
        raise ValueError(
            f"--task {spec}: no module named {module_name!r}; install it, or run from the folder that holds "
            f"it (or add that folder to PYTHONPATH)"
        ) from e
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
            close = difflib.get_close_matches(part, names, n=1)
            hint = (
                f"did you mean {module_name}:{close[0]}?"
                if close
                else f"it has {', '.join(names[:8]) or 'none'}"
            )
            raise ValueError(f"--task {spec}: module {module_name} has no function {attr!r}; {hint}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(
            f"--task {spec}: {module_name}:{attr} is a {type(factory).__name__}, not a function returning a Task"
        )
    return full, factory


_SIMPLE = (bool, int, float, str, Path)


def _target_type(factory: Callable[..., Any], parameter: inspect.Parameter) -> type | None:
    """The simple type (bool, int, float, str, Path) a parameter declares or its default implies."""
    try:
        hints = typing.get_type_hints(factory.__init__ if isinstance(factory, type) else factory)  # type: ignore[misc]
    except Exception:  # annotations that do not resolve: fall back on the default's type
        hints = {}
    hint = hints.get(parameter.name)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = options[0] if len(options) == 1 else None
    if isinstance(hint, type) and issubclass(hint, _SIMPLE):
        return hint
    default = parameter.default
    if default is not inspect.Parameter.empty and default is not None and isinstance(default, _SIMPLE):
        return type(default)
    return None


def _convert(spec: str, name: str, value: str, target: type | None, factory_name: str) -> Any:
    if target is None or target is str:
        return value
    if target is bool:
        lowered = value.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--task-arg {name}={value}: {factory_name}'s {name} is a bool; give true or false")
    try:
        return target(value)
    except ValueError:
        raise ValueError(
            f"--task-arg {name}={value}: {factory_name}'s {name} is {'an' if target is int else 'a'} "
            f"{target.__name__}; got {value!r}"
        ) from None


def load_task(spec: str, args: Mapping[str, str] | Sequence[str] = ()) -> Task:
    """The :class:`Task` that ``spec`` makes with ``args``.

    Args:
        spec: a built-in task (:data:`BUILTIN_TASKS`: ``sst``, ``pyast``) or
            ``package.module:function``, the function returning a :class:`Task`.
        args: the function's keyword arguments as strings (``{"hidden_dim": "32"}`` or
            ``["hidden_dim=32"]``, as ``--task-arg`` gives them), converted to the types its
            signature declares (bool, int, float, str, Path; else its default's type).

    Raises:
        ValueError: the spec names no module or function, an argument is unknown or does not
            convert; the message names ``--task`` / ``--task-arg``, the value and the fix.
        TypeError: the function returned something other than a :class:`Task`.

    >>> task = load_task("sst", {"generate": "30", "max_train": "30", "hidden_dim": "8", "embedding_dim": "8"})
    >>> task.name, len(task.train), task.settings["hidden_dim"]
    ('sst', 30, 8)
    """
    values = parse_task_args(args) if not isinstance(args, Mapping) else dict(args)
    full, factory = _resolve(spec)
    factory_name = full.rpartition(":")[2]
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: pass the arguments as they are
        signature = None
    kwargs: dict[str, Any] = {}
    if signature is not None:
        parameters = signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        named = [
            n
            for n, p in parameters.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        for name, value in values.items():
            if name not in parameters and not takes_any:
                close = difflib.get_close_matches(name, named, n=1)
                hint = f"did you mean {close[0]}?" if close else ""
                takes = f"it takes {', '.join(named)}" if named else "it takes no argument"
                raise ValueError(
                    f"--task-arg {name}={value}: {factory_name} (--task {spec}) has no argument {name!r}; "
                    f"{takes}{'; ' + hint if hint else ''}"
                )
            target = _target_type(factory, parameters[name]) if name in parameters else None
            kwargs[name] = _convert(spec, name, value, target, factory_name)
        missing = [
            n
            for n, p in parameters.items()
            if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and n not in kwargs
        ]
        if missing:
            raise ValueError(
                f"--task {spec}: {factory_name} needs {', '.join(missing)}; pass "
                + " ".join(f"--task-arg {n}=VALUE" for n in missing)
            )
    else:
        kwargs = dict(values)
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise TypeError(
            f"--task {spec}: {factory_name} returned a {type(task).__name__}, not a torchfold.train.Task; "
            "return Task(name=..., train=..., build=..., model=..., loss=...)"
        )
    return task
