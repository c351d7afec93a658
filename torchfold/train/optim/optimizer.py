"""An optimizer wrapper for steps made of a varying number of minibatches, with learning-rate rules.

The training loop stays ordinary: ``loss.backward()`` per minibatch, ``optimizer.step()`` and
``optimizer.zero_grad()`` per step; gradients live in ``p.grad`` all the time, so clipping,
``GradScaler`` and gradient logging work between backward and step.

Semantics (``reduction="mean"``): a step whose global batch of ``B`` samples is split into ``m``
minibatches, spread over the ranks in any way (a rank may have none), updates the parameters
exactly like one step of the wrapped optimizer on the mean loss over the ``B`` samples, with the
learning rate multiplied by the rule's factor. Minibatches may differ in size: a minibatch of
``n_i`` samples, run inside ``with optimizer.minibatch(n_i):``, has its mean-loss gradient ``g_i``
weighted by ``n_i`` as it reaches ``p.grad`` (a hook on each parameter's gradient accumulator,
which runs only when a backward writes ``p.grad``, so ``torch.autograd.grad`` is left alone: the
one place where gradients are weighted), and :meth:`~AccumulatingOptimizer.synchronize` sums over the ranks and divides once, by
``B = sum(n_i)`` counted over all ranks. With ``reduction="sum"`` (losses summed over samples) the
gradients are summed and not divided. A ``loss.backward()`` outside ``minibatch()`` is plain
PyTorch: its gradient is used as it is (averaged over the ranks that have one).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar, cast

import torch
from torch.nn.parallel import DistributedDataParallel

from torchfold._validate import check_int
from torchfold.engine.resolve import device_for
from torchfold.train.distributed.devices import SentValues, accumulation_dtype, is_xla, synchronize, xla_sync
from torchfold.train.distributed.world import all_reduce_sum_, world
from torchfold.train.optim.lr import scaled_lr

_T = TypeVar("_T")
__all__ = ["AccumulatingOptimizer", "check_max_grad_norm", "sample_weight"]

# The trace module's rules (constant, linear, sqrt: scaled_lr) plus AdaScale, which needs gradients.
_LRRuleName = Literal["constant", "linear", "sqrt", "adascale"]
_LR_RULES: tuple[_LRRuleName, ...] = ("constant", "linear", "sqrt", "adascale")

# Stats that ride along with the gradients in the same all-reduce.
_SAMPLES, _MINIBATCHES, _PLAIN_RANKS, _WEIGHTED_SQNORM, _UNIT = 0, 1, 2, 3, 4
_N_STATS = 5


def sample_weight(num_samples: float, reduction: str, unit: float = 1.0) -> float:
    """What a loss or gradient over ``num_samples`` samples counts for in its step: the weighting rule.

    Every way a step runs weighs by this one function: :meth:`AccumulatingOptimizer.minibatch`
    and :meth:`~AccumulatingOptimizer.synchronize`, the step runners, and the programs they
    replay (:class:`~torchfold.train.capture.xla_programs.XlaPrograms`). With ``reduction="mean"``
    (a minibatch's loss averaged over its samples) it is ``num_samples / unit``; with ``"sum"``
    (losses summed over the samples) it is 1: every sample counts once already. Its uses:

    * a minibatch's gradient is weighted by ``sample_weight(n, reduction, unit)``;
    * the step's summed gradient is divided once by ``sample_weight(B, reduction, unit)``, ``B``
      the step's samples over all ranks (replicas): the mean gradient over the step's samples
      however they were split among minibatches and ranks (with ``"sum"``: no division);
    * a minibatch's loss enters the step's loss sum weighted by ``sample_weight(n, reduction)``,
      which is the sum of the samples' losses either way; the step's mean loss is that sum over
      ``B``.

    ``unit`` (the optimizer's ``minibatch_size``) changes no result, only the passes over the
    gradients: a full minibatch has weight 1 (nothing to multiply), and so has the divisor of a
    step of one full minibatch. A step of one minibatch needs no weighting at all: its weight and
    its divisor are the same number.

    >>> sample_weight(6, "mean", unit=4), sample_weight(6, "sum", unit=4), sample_weight(6, "mean")
    (1.5, 1.0, 6.0)
    """
    if reduction == "mean":
        return num_samples / unit
    if reduction == "sum":
        return 1.0
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def _accumulate_hook(
    ref: weakref.ref[AccumulatingOptimizer], key: int, grads: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor | None, ...] | None:
    """Before a gradient is added to ``p.grad`` (a backward, never ``torch.autograd.grad``): weigh it."""
    optimizer = ref()
    if optimizer is None or grads[0] is None:
        return None
    optimizer._weighed.add(key)
    weighted = optimizer._weigh(grads[0])
    return None if weighted is None else (weighted, *grads[1:])


def _accumulated_hook(ref: weakref.ref[AccumulatingOptimizer], param: torch.Tensor) -> None:
    """After a gradient was added to ``p.grad``: check that it went through :func:`_accumulate_hook`."""
    optimizer = ref()
    if optimizer is not None:
        optimizer._check_weighed(param)


class AccumulatingOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer so that each step accumulates any number of minibatches and all-reduces once.

    The loop stays ordinary. For each minibatch of this rank in the current step, run the forward
    and ``loss.backward()`` inside ``with optimizer.minibatch(num_samples):`` (or call
    ``optimizer.backward(loss, num_samples)``, the same in one line); then call :meth:`step` once
    per step on every rank (also on a rank that had no minibatch in this step: it contributes zero
    gradients and still joins the all-reduce, so nothing hangs), then :meth:`zero_grad`.
    :meth:`step` calls :meth:`synchronize` if you have not: call it yourself first to see the
    step's averaged gradients in ``p.grad``, e.g. to clip them or to unscale them with a
    ``GradScaler`` (after ``synchronize()``, so that every rank sees the same inf/NaN check)::

        for step in loader:
            for mb in step:
                with optimizer.minibatch(mb.num_samples):
                    scaler.scale(loss_of(mb)).backward()
            optimizer.synchronize()          # all-reduce once, divide once
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

    A plain ``loss.backward()`` outside :meth:`minibatch` works as in PyTorch (its gradient is
    used as it is; over several ranks, averaged over those that have one), for the ``"constant"``
    rule, which needs no sample count. A step mixing the two, or a :meth:`step` for which no rank
    produced any gradient, raises ``RuntimeError``.

    The learning rate in ``param_groups`` stays the reference learning rate: :meth:`step` multiplies
    it by the rule's factor for the update only and restores it, so LR schedulers attached to this
    wrapper (or to the wrapped optimizer) keep working. With global batch ``B`` and reference batch
    ``R``, the factor is 1 (``"constant"``), ``B / R`` (``"linear"``), ``sqrt(B / R)`` (``"sqrt"``),
    or the AdaScale gain (``"adascale"``, Johnson et al. 2020)::

        gain = (var / R + sqr) / (var / B + sqr)

    where ``var`` is the per-sample gradient variance (trace of the covariance) and ``sqr`` the
    squared norm of the true gradient, both estimated from the spread of this step's
    per-minibatch gradients (each minibatch's own gradient, seen by the gradient hook before it
    joins ``p.grad``; so one backward per minibatch) and smoothed over steps with
    ``adascale_smoothing``. The gain is 1 when ``B == R``, lies between 1 and ``B / R``, stays 1
    (never NaN) until some step has had at least two minibatches to estimate the variance from,
    and does not change when a ``GradScaler`` scales the loss.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        lr_rule: ``"constant"`` (default), ``"linear"``, ``"sqrt"`` or ``"adascale"``.
        ref_batch_size: the batch size the learning rate was tuned for; required unless the rule
            is ``"constant"``.
        reduction: ``"mean"`` (default; losses averaged over a minibatch's samples) or ``"sum"``.
        module: the model, needed only when it is a ``DistributedDataParallel``: the wrapper then
            keeps it in ``no_sync()`` mode from now on (until :meth:`close`), since it does the
            gradient all-reduce itself, once per step; DDP's per-backward all-reduce would hang
            when ranks run different numbers of minibatches.
        minibatch_size: the usual number of samples per minibatch, the same on every rank
            (optional, no effect on the result): gradients are then weighted by
            ``num_samples / minibatch_size``, so a full minibatch needs no weighting pass over the
            gradients, and a step of one full minibatch no division pass. Where it is unset,
            ``TraceTrainer`` weighs by its loader's ``batch_size`` (:meth:`default_minibatch_size`),
            leaving this attribute as it is.
        adascale_smoothing: weight of the past in the exponential moving averages of AdaScale's
            variance estimates, in ``[0, 1)`` (default 0.9; 0 uses each step's estimate alone).
        max_grad_norm: clip the step's gradient to this total 2-norm (``clip_grad_norm_``) in
            :meth:`synchronize`, after the all-reduce and the division, before the update: the norm
            of the mean gradient over the global batch, the same on every rank (default ``None``: no
            clipping).
        grad_scaler: a ``torch.amp.GradScaler`` whose scale the step's losses were multiplied by
            before their backward (``TraceTrainer(precision="fp16")`` does it): :meth:`synchronize`
            unscales the all-reduced gradient (before clipping it), and :meth:`step` skips the update
            of a step whose gradient overflowed and updates the scale (default ``None``).

    >>> model = torch.nn.Linear(3, 1)
    >>> opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                             lr_rule="linear", ref_batch_size=4)
    >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
    >>> for xb, yb in zip(x.split(3), y.split(3)):  # minibatches of 3, 3 and 2 samples
    ...     with opt.minibatch(len(xb)):
    ...         torch.nn.functional.mse_loss(model(xb), yb).backward()
    >>> opt.synchronize()  # p.grad: the gradient of the mean loss over the 8 samples
    >>> norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    >>> opt.step()  # lr 0.1 * 8 / 4 for this update
    >>> opt.zero_grad()
    >>> opt.last_batch_size, opt.last_lr_factor, opt.param_groups[0]["lr"]
    (8, 2.0, 0.1)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        lr_rule: _LRRuleName = "constant",
        ref_batch_size: int | None = None,
        reduction: Literal["mean", "sum"] = "mean",
        module: torch.nn.Module | None = None,
        adascale_smoothing: float = 0.9,
        minibatch_size: int | None = None,
        max_grad_norm: float | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        # torch.optim.Optimizer.__init__ is deliberately not called: the wrapped optimizer owns the
        # parameter groups and state; this class only forwards to it (schedulers need the isinstance).
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, AccumulatingOptimizer):
            raise TypeError("optimizer is already an AccumulatingOptimizer; wrap the plain optimizer once")
        if lr_rule not in _LR_RULES:
            raise ValueError(f"lr_rule must be one of {list(_LR_RULES)}, got {lr_rule!r}")
        if ref_batch_size is not None:
            check_int("ref_batch_size", ref_batch_size)
        if ref_batch_size is None and lr_rule != "constant":
            raise ValueError(
                f"lr_rule={lr_rule!r} scales the learning rate relative to a reference batch size: "
                f"pass ref_batch_size= (the batch size the learning rate was tuned for)"
            )
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if not 0.0 <= adascale_smoothing < 1.0:
            raise ValueError(f"adascale_smoothing must be in [0, 1), got {adascale_smoothing!r}")
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module or None, got {type(module).__name__}")
        self.optimizer = optimizer
        self.lr_rule: _LRRuleName = lr_rule
        self.ref_batch_size = ref_batch_size
        self.reduction = reduction
        self.adascale_smoothing = adascale_smoothing
        if minibatch_size is not None:
            check_int("minibatch_size", minibatch_size)
        self.minibatch_size = minibatch_size
        #: the step's gradient is clipped to this total norm in :meth:`synchronize` (None: not clipped);
        #: a runner that computes a step's gradients itself (:meth:`computed_step`) must clip to it as well
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        #: unscales the step's gradient and skips overflowed updates (see ``grad_scaler``)
        self.grad_scaler = grad_scaler
        #: the total norm of the last step's gradient before clipping (a tensor on the device: read
        #: it when you like; ``None`` without ``max_grad_norm``)
        self.last_grad_norm: torch.Tensor | None = None
        self._default_minibatch_size: int | None = None  # inside default_minibatch_size()
        self.module = module
        self._no_sync = contextlib.ExitStack()
        if isinstance(module, DistributedDataParallel):
            if module.broadcast_buffers and any(True for _ in module.module.buffers()):
                raise ValueError(
                    "module is a DistributedDataParallel with buffers and broadcast_buffers=True: DDP would "
                    "broadcast them in every forward, and ranks run different numbers of forwards per step. "
                    "Wrap the model with DistributedDataParallel(..., broadcast_buffers=False) (named "
                    "forward_sync_buffers=False in newer PyTorch)"
                )
            self._no_sync.enter_context(module.no_sync())
        # The gradient hooks: they weigh each minibatch's gradient by its sample count. They sit on
        # each parameter's gradient accumulator (the autograd node that writes p.grad), which only
        # a backward runs; a parameter that does not require grad has none yet, so parameters are
        # (re)scanned at every minibatch and synchronize(): unfrozen ones and added groups included.
        self._hooked: dict[int, tuple[Any, torch.utils.hooks.RemovableHandle]] = {}
        self._post_hooked: set[int] = set()
        self._weighed: set[int] = set()  # parameters whose gradient _accumulate_hook just saw
        self._hook_params(self._params())
        # This step's local state (reset by zero_grad() and after step()).
        self._weight: float | None = None  # inside minibatch(): the weight of the gradients arriving
        self._numbers = SentValues(limit=256)  # see _number
        self._minibatch_samples = 0
        self._local_samples = 0
        self._local_minibatches = 0
        self._plain = False  # a backward outside minibatch() reached p.grad in this step
        self._local_sqnorm: torch.Tensor | None = None
        self._synced = False
        self._factor = 1.0
        self._needs_zero_grad = False  # synchronize() ran: p.grad holds a finished step's gradient
        # AdaScale's smoothed estimates and progress; part of state_dict().
        self._var_avg: float | None = None
        self._sqr_avg: float | None = None
        self.scale_invariant_steps = 0.0
        self.steps = 0
        self.last_batch_size = 0
        self.last_num_minibatches = 0
        self.last_lr_factor = 1.0

    # -- pass-through to the wrapped optimizer -------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer (only between steps).

        Its parameters' ``.grad`` is cleared: gradients they collected outside the optimizer
        (which :meth:`zero_grad` does not reach) belong to earlier steps and were never weighted,
        so the group's first update uses only that step's gradient.
        """
        if self._step_in_progress():
            raise RuntimeError("add_param_group() in the middle of a step; call it after step()")
        self.optimizer.add_param_group(param_group)
        self._check_unweighted(self._hook_params(self._params()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' ``.grad`` and start a new step (a step skipped by a ``GradScaler`` included)."""
        if self._weight is not None:
            raise RuntimeError("zero_grad() inside optimizer.minibatch(); call it after step()")
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._reset_step()
        self._needs_zero_grad = False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.optimizer!r}, lr_rule={self.lr_rule!r}, "
            f"ref_batch_size={self.ref_batch_size}, reduction={self.reduction!r})"
        )

    def close(self) -> None:
        """Give a ``DistributedDataParallel`` module back its own gradient synchronization."""
        self._no_sync.close()

    def __enter__(self) -> AccumulatingOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- accumulation ----------------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _hook_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Hook the gradient accumulator of every parameter that requires grad; returns the new ones."""
        new = [p for p in params if p.requires_grad and id(p) not in self._hooked]
        for p in new:
            self._hook(p)
        return new

    def _hook(self, p: torch.Tensor) -> None:
        ref = weakref.ref(self)
        # The leaf's AccumulateGrad node; held here, since the tensor only keeps a weak reference.
        with torch.enable_grad():  # also when called from a hook during backward (grad mode off)
            view_fn = p.view_as(p).grad_fn
        node = view_fn.next_functions[0][0] if view_fn is not None else None
        if node is None:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} requires grad but has no gradient accumulator"
            )
        handle = node.register_prehook(functools.partial(_accumulate_hook, ref, id(p)))
        old = self._hooked.get(id(p))
        if old is not None:
            old[1].remove()
        self._hooked[id(p)] = (node, handle)
        if id(p) not in self._post_hooked:
            # On the tensor itself, so it outlives the node (which model.to(dtype) replaces).
            p.register_post_accumulate_grad_hook(functools.partial(_accumulated_hook, ref))
            self._post_hooked.add(id(p))

    def _check_unweighted(self, new: list[torch.Tensor]) -> None:
        """Newly hooked parameters must not hold gradients of this step's earlier, weighted minibatches.

        Between steps, what they hold was collected outside the optimizer in earlier steps (which
        ``zero_grad()`` did not reach) and never weighted: it is cleared, so that their first
        update uses only the step's own gradient.
        """
        if self._local_minibatches and any(p.grad is not None for p in new):
            shapes = [tuple(p.shape) for p in new if p.grad is not None]
            raise RuntimeError(
                f"parameters of shapes {shapes} got gradients in this step before they were in the optimizer or "
                "required grad, so those were not weighted by sample count; unfreeze parameters and add groups "
                "between steps (after zero_grad()), then run the step again"
            )
        for p in new:
            p.grad = None

    def _check_weighed(self, p: torch.Tensor) -> None:
        """A gradient reached ``p.grad`` without the weighting hook: its accumulator node was replaced."""
        if id(p) in self._weighed:
            self._weighed.discard(id(p))
            return
        for q in self._params():  # model.to() replaced them all: the next backward uses the new nodes
            if q.requires_grad:
                self._hook(q)
        if self._weight is None and not self._local_minibatches:
            self._plain = True  # a plain backward: used as it is, nothing was missed
            return
        raise RuntimeError(
            f"a parameter of shape {tuple(p.shape)} got its gradient without the AccumulatingOptimizer's "
            "weighting: its gradient accumulator was replaced after the optimizer was created (e.g. "
            "model.to(dtype or device) changed it); create the optimizer after moving the model, or call "
            "optimizer.zero_grad() and run this step again"
        )

    def _unit(self) -> float:
        """What a minibatch's sample count is measured in (see ``minibatch_size``)."""
        size = self.minibatch_size if self.minibatch_size is not None else self._default_minibatch_size
        return float(size) if size is not None else 1.0

    @contextlib.contextmanager
    def default_minibatch_size(self, minibatch_size: int | None) -> Iterator[None]:
        """Inside, an unset ``minibatch_size`` counts as ``minibatch_size`` (``None``: as unset).

        For a loop that knows the usual size of its minibatches (``TraceTrainer``: its loader's
        ``batch_size``) around its steps, and around making the runner of its steps: the user's
        setting wins where there is one, and stays as it is. Use the same on every rank, and for
        a whole step.
        """
        if minibatch_size is not None:
            check_int("minibatch_size", minibatch_size)
        previous, self._default_minibatch_size = self._default_minibatch_size, minibatch_size
        try:
            yield
        finally:
            self._default_minibatch_size = previous

    def _step_in_progress(self) -> bool:
        return bool(self._local_minibatches or self._plain or self._weight is not None)

    def _reset_step(self) -> None:
        self._local_samples = self._local_minibatches = 0
        self._plain = False
        self._local_sqnorm = None
        self._synced = False

    def _check_fresh_gradients(self) -> None:
        """The first gradient of a step must not land on the previous step's."""
        if self._needs_zero_grad and any(p.grad is not None for p in self._params()):
            raise RuntimeError(
                "the parameters still hold the gradients of the previous step; call optimizer.zero_grad() after "
                "optimizer.step(), before the next step's first backward()"
            )
        self._needs_zero_grad = False
        if self._synced:  # synchronized, but no step() followed (e.g. a GradScaler skipped it)
            self._reset_step()

    def _weigh(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The gradient hook: weigh one parameter's gradient of the minibatch being backpropagated."""
        if not (self._local_minibatches or self._plain):
            self._check_fresh_gradients()
        if self._weight is None:
            if self._local_minibatches:
                raise RuntimeError(
                    "a loss.backward() outside optimizer.minibatch(num_samples) in a step whose other minibatches "
                    "ran inside it: its gradient would be mixed in unweighted; run every backward of the step "
                    "inside optimizer.minibatch(...)"
                )
            self._plain = True
            return None
        if self.lr_rule == "adascale":
            # n_i * |g_i|^2 (see _adascale_gain), g_i = grad * w_i / n_i the mean-loss gradient
            # whatever the reduction, w_i = sample_weight(n_i, reduction)
            n = self._minibatch_samples
            w = sample_weight(n, self.reduction)
            term = grad.detach().pow(2).sum() * (w * w / n)
            self._local_sqnorm = term if self._local_sqnorm is None else self._local_sqnorm + term
        if is_xla(grad.device):  # (by 1.0 too: one graph whatever the weight)
            return grad * self._number("weight", self._weight, grad)
        return grad * self._weight if self._weight != 1.0 else None

    def _number(self, role: str, value: float, like: torch.Tensor) -> torch.Tensor:
        """``value`` for ``role`` as a 0-dim tensor of ``like``'s dtype on its (XLA) device: a
        graph input of its own whatever the value (see ``SentValues``)."""
        return self._numbers.full(role, (), value, like.dtype, like.device)

    @contextlib.contextmanager
    def minibatch(self, num_samples: int) -> Iterator[None]:
        """Backpropagate one minibatch of ``num_samples`` samples inside this context.

        Gradients reaching ``p.grad`` inside it are weighted by ``num_samples`` (with
        ``reduction="mean"``), so that the step's gradient is the mean over all its samples
        however they were split. Run one ``loss.backward()`` per context, on the loss of that
        minibatch alone (for ``reduction="mean"``: averaged over its samples, as
        ``torch.nn.functional`` losses do by default).

        Args:
            num_samples: how many samples the minibatch has (its share of the global batch).
        """
        check_int("num_samples", num_samples, hint="give the minibatch's sample count")
        if self._weight is not None:
            raise RuntimeError("optimizer.minibatch() is already open; one minibatch at a time")
        if isinstance(self.module, DistributedDataParallel) and self.module.require_backward_grad_sync:
            raise RuntimeError(
                "the DistributedDataParallel module is no longer in no_sync() mode (close() was called or "
                "someone re-enabled it); its own all-reduce would hang ranks with fewer minibatches"
            )
        if not (self._local_minibatches or self._plain):
            self._check_fresh_gradients()
        if self._plain:
            raise RuntimeError(
                "a loss.backward() outside optimizer.minibatch(num_samples) already ran in this step: its gradient "
                "would be mixed in unweighted; run every backward of the step inside optimizer.minibatch(...)"
            )
        if self._synced:
            raise RuntimeError("optimizer.minibatch() after synchronize(); call step() and zero_grad() first")
        params = self._params()
        # Parameters unfrozen, or groups added to the wrapped optimizer, since the last scan.
        self._check_unweighted(self._hook_params(params))
        self._weight = sample_weight(num_samples, self.reduction, self._unit())
        self._minibatch_samples = num_samples
        try:
            yield
        finally:
            self._weight = None
        self._local_samples += num_samples
        self._local_minibatches += 1
        if params:
            # On XLA, one lazy graph per minibatch: compiled once and reused however many
            # minibatches a step has, instead of one new graph per distinct count.
            synchronize(params[0].device)

    def _unhook(self) -> None:
        """Remove the gradient hooks, and let go of the gradient accumulators they sit on."""
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()

    def computed_step(
        self,
        run: Callable[[list[float]], _T],
        *,
        num_samples: int | None = None,
        num_minibatches: int | None = None,
        reduced: bool = False,
        clipped: bool = False,
    ) -> _T:
        """End a step whose update a step runner computes itself (compiled, replayed); ``run``'s result.

        The one way a runner hands this optimizer a step of its own making. ``run(lrs)`` gets each
        param group's learning rate after the LR rule (the param groups hold the same rates while it
        runs, and their own afterwards) and must update the parameters as the wrapped optimizer's
        ``step()`` would; this then records the step as :meth:`step` does (its counts, the rule's
        factor). Two kinds of steps:

        * without ``num_samples``: the step's minibatches ran in :meth:`minibatch`, so this runs
          :meth:`synchronize` first (all-reduce, division, clipping), and ``run`` updates from
          ``p.grad`` (e.g. a compiled ``optimizer.step()``);
        * with ``num_samples`` and ``num_minibatches``: ``run`` computes the gradients too (e.g.
          replayed programs), weighted by :func:`sample_weight` as :meth:`minibatch` and
          :meth:`synchronize` weigh them, and never into ``p.grad`` through autograd's gradient
          accumulators: this optimizer lets go of them first (a CUDA graph capture needs that: an
          accumulator made on another stream breaks it), and takes them again at the next
          :meth:`minibatch`. In one process, or, with ``reduced``, in several whose gradients the
          runner has summed over the ranks already: the counts are then the step's over all
          ranks. With :attr:`max_grad_norm`, ``run`` must clip the step's mean gradient to it
          before the update, and say so with ``clipped=True``.

        Raises:
            RuntimeError: a :attr:`grad_scaler` (a runner's update cannot be skipped when the gradient
                overflowed); with ``num_samples``: several processes without ``reduced`` (their
                gradients must be all-reduced: use :meth:`minibatch` and :meth:`step`),
                ``lr_rule="adascale"`` (it needs the gradients' statistics), a :attr:`max_grad_norm`
                without ``clipped``, or a step already under way.
            ValueError: one of ``num_samples`` and ``num_minibatches`` without the other.
        """
        if self.grad_scaler is not None:
            raise RuntimeError(
                "computed_step() with a grad_scaler: a step runner's update cannot be skipped when the gradient "
                "overflowed; use minibatch() and step() (TraceTrainer: compile='off')"
            )
        if (num_samples is None) != (num_minibatches is None):
            raise ValueError(
                f"computed_step(num_samples={num_samples}, num_minibatches={num_minibatches}): give both (a step "
                "whose gradients the runner computed) or neither (a step whose minibatches ran in minibatch())"
            )
        if num_samples is None or num_minibatches is None:
            self.synchronize()
            return self._update(run)
        check_int("num_samples", num_samples)
        check_int("num_minibatches", num_minibatches)
        if world().size != 1 and not reduced:
            raise RuntimeError(
                f"computed_step() in a run of {world().size} processes: their gradients must be all-reduced; use "
                "optimizer.minibatch(num_samples) and optimizer.step(), or all-reduce them and pass reduced=True"
            )
        if self.lr_rule == "adascale":
            raise RuntimeError(
                "computed_step(num_samples=...) with lr_rule='adascale', which needs the gradients' statistics; "
                "use minibatch() and step()"
            )
        if self.max_grad_norm is not None and not clipped:
            raise RuntimeError(
                f"computed_step() with max_grad_norm={self.max_grad_norm}: the step's gradient never reaches "
                "p.grad here to be clipped, and this runner's update does not clip it (clipped=False); use "
                "minibatch() and step() (TraceTrainer: compile='off')"
            )
        if self._step_in_progress() or self._synced:
            raise RuntimeError(
                "computed_step(num_samples=...) in the middle of a step; call it after step() and zero_grad()"
            )
        self._unhook()  # (cheap when nothing is hooked: a minibatch() since the last one hooks them)
        self._factor = self._rule_factor(num_samples)
        result = self._update(run)
        self._needs_zero_grad = False
        self.last_batch_size = num_samples
        self.last_num_minibatches = num_minibatches
        self.last_lr_factor = self._factor
        return result

    def _update(self, run: Callable[[list[float]], _T]) -> _T:
        """``run(lrs)`` with the rule's learning rates (in the param groups too while it runs); the
        step counted. The update of :meth:`step` and :meth:`computed_step` alike."""
        factor = self._factor
        ref_lrs = [group["lr"] for group in self.optimizer.param_groups]
        rates = [lr * factor for lr in ref_lrs]
        try:
            for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
                group["lr"] = rate
            result = run(rates)
        finally:
            for group, lr in zip(self.optimizer.param_groups, ref_lrs, strict=True):
                group["lr"] = lr
        self._synced = False
        self.steps += 1
        self.scale_invariant_steps += factor if self.lr_rule == "adascale" else 1.0
        return result

    def minibatch_unit(self) -> float:
        """What a minibatch's sample count is measured in when gradients are weighted (``minibatch_size``, or 1)."""
        return self._unit()

    def params_device(self) -> torch.device:
        """The device of the first parameter (the CPU when there is none): the engine's ``device_for``."""
        return device_for(self._params())

    def backward(self, loss: torch.Tensor, num_samples: int) -> None:
        """``loss.backward()`` inside ``minibatch(num_samples)``: one minibatch in one line."""
        with self.minibatch(num_samples):
            loss.backward()

    def synchronize(self) -> None:
        """Finish the step's gradients: all-reduce once, divide once, leave the result in ``p.grad``.

        Every rank must call it once per step (also a rank without minibatches; :meth:`step`
        calls it if you have not). Afterwards ``p.grad`` holds the gradient of the mean loss over
        the step's global batch (``reduction="mean"``) on every rank, ready for clipping or a
        ``GradScaler``'s ``unscale_``; a parameter that no rank has a gradient for gets ``None``.

        Raises:
            RuntimeError: no rank produced a gradient in this step, or some ranks ran plain
                backwards and others minibatches with sample counts.
        """
        if self._synced:
            return
        if self._weight is not None:
            raise RuntimeError(
                "synchronize() inside optimizer.minibatch(); call it after the step's minibatches"
            )
        params = self._params()
        if not params:
            raise RuntimeError("the optimizer has no parameters to synchronize")
        unfrozen = self._hook_params(params)
        self._check_unweighted(unfrozen)
        if not self._local_minibatches and any(p.grad is not None for p in unfrozen):
            self._plain = True  # a parameter unfrozen since the last scan, from a plain backward
        device = params[0].device
        stats_dtype = accumulation_dtype(device)
        local = [0.0] * (_N_STATS + len(params))
        local[_SAMPLES] = self._local_samples
        local[_MINIBATCHES] = self._local_minibatches
        local[_PLAIN_RANKS] = float(self._plain)
        local[_UNIT] = self._unit()
        grads: list[torch.Tensor] = []
        for i, p in enumerate(params):
            if p.grad is not None:
                local[_N_STATS + i] = 1.0
            grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
        if world().size == 1 and self._local_sqnorm is None:
            # One process: nothing to sum, and nothing to read back, so the host goes on to the
            # update while the device still runs the minibatches (no wait for it here).
            totals = local
        else:
            stats = torch.tensor(local, dtype=stats_dtype).to(device)
            if self._local_sqnorm is not None:
                stats[_WEIGHTED_SQNORM] = self._local_sqnorm.to(device=device, dtype=stats_dtype)
            all_reduce_sum_([*grads, stats])  # idle ranks join with zeros
            totals = stats.tolist()
        num_samples, num_minibatches = round(totals[_SAMPLES]), round(totals[_MINIBATCHES])
        plain_ranks = round(totals[_PLAIN_RANKS])
        self._reset_step()
        if totals[_UNIT] != self._unit() * world().size:
            raise RuntimeError(
                f"the ranks' optimizers have different minibatch_size (this rank: {self.minibatch_size}); give "
                "every rank the same (or none)"
            )
        if num_minibatches == 0 and plain_ranks == 0:
            raise RuntimeError(
                "step() with no gradient from any rank: no loss.backward() ran since the last zero_grad(); "
                "backpropagate at least one minibatch (on some rank) before optimizer.step()"
            )
        if num_minibatches and plain_ranks:
            raise RuntimeError(
                f"{plain_ranks} rank(s) ran loss.backward() outside optimizer.minibatch(num_samples) while others "
                "gave sample counts; run every backward inside optimizer.minibatch(...) on every rank"
            )
        if plain_ranks and self.lr_rule != "constant":
            raise RuntimeError(
                f"lr_rule={self.lr_rule!r} needs the step's sample count, but loss.backward() ran outside "
                "optimizer.minibatch(num_samples); wrap each minibatch's backward in it"
            )
        with torch.no_grad():
            if self.lr_rule == "adascale":
                total = torch.stack([g.to(stats_dtype).pow(2).sum() for g in grads]).sum()
                grad_sqnorm = float(total) / num_samples**2
                factor = self._adascale_gain(
                    num_samples, num_minibatches, totals[_WEIGHTED_SQNORM], grad_sqnorm
                )
            else:
                factor = self._rule_factor(num_samples) if num_minibatches else 1.0
            if plain_ranks:
                divisor = float(plain_ranks)
            else:
                divisor = sample_weight(num_samples, self.reduction, self._unit())
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                if totals[_N_STATS + i] == 0:
                    p.grad = None  # no rank produced a gradient for it: leave it out of the update
                    continue
                if is_xla(g.device):
                    g.div_(self._number("divisor", divisor, g))  # the one place where gradients are divided
                elif divisor != 1.0:
                    g.div_(divisor)
                p.grad = g
        self._finish_gradients()
        self._factor = factor
        self._synced = True
        self._needs_zero_grad = True
        self.last_batch_size = num_samples
        self.last_num_minibatches = num_minibatches or plain_ranks
        self.last_lr_factor = factor

    def _finish_gradients(self) -> None:
        """The step's mean gradient, unscaled (``grad_scaler``) and clipped (``max_grad_norm``), in that order."""
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            # one norm over every parameter's gradient (foreach where it can): no read back to the host
            grads = [p for p in self._params() if p.grad is not None]
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """End the step: :meth:`synchronize` (unless done), then update with the rule's learning rate.

        Every rank must call it once per step, also a rank without minibatches in this step. With a
        :attr:`grad_scaler`, the update is the scaler's (skipped where the gradient overflowed), and
        the scale is updated.

        ``closure`` is called once, first (gradients enabled), and its result returned, as
        ``torch.optim`` optimizers do: Lightning's manual optimization passes one, which runs its
        hooks. Run the minibatches' backwards in :meth:`minibatch`, not in the closure (there a
        backward is a plain one, as outside :meth:`minibatch`).
        """
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self.synchronize()
        self._update(self._own_update)
        return result

    def _own_update(self, lrs: list[float]) -> None:
        """The wrapped optimizer's update (the rates ``lrs`` are in its param groups), or the grad scaler's."""
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.step(self.optimizer)  # skipped where the unscaled gradient is not finite
            scaler.update()
        else:
            self.optimizer.step()

    def _rule_factor(self, batch_size: int) -> float:
        if self.lr_rule == "constant":
            return 1.0
        return scaled_lr(1.0, batch_size, cast(int, self.ref_batch_size), self.lr_rule)

    def _adascale_gain(self, n: int, m: int, weighted_sqnorm: float, grad_sqnorm: float) -> float:
        """AdaScale's gain from the per-minibatch gradient spread.

        With minibatch ``i`` of ``n_i`` samples and mean-loss gradient ``g_i``, the step's mean
        gradient ``g = sum(n_i g_i) / n`` and ``A = sum(n_i |g_i|^2)``: ``E[A - n |g|^2] = (m - 1) var``
        for the per-sample variance ``var``, and ``E[|g|^2] = sqr + var / n``. These unbiased
        estimates (clipped at 0) feed moving averages; a step with one minibatch has no spread and
        leaves them unchanged, and so does a step whose gradients are not finite (an overflow that a
        ``GradScaler``, or the loop, skips: one such step must not make the averages NaN for good).
        The gain is kept between 1 and ``B / R``.
        """
        if m > 1 and math.isfinite(weighted_sqnorm) and math.isfinite(grad_sqnorm):
            var = max((weighted_sqnorm - n * grad_sqnorm) / (m - 1), 0.0)
            sqr = max(grad_sqnorm - var / n, 0.0)
            if (
                self._var_avg is None
                or self._sqr_avg is None
                or not math.isfinite(
                    self._var_avg + self._sqr_avg
                )  # NaN from a checkpoint of an older version
            ):
                self._var_avg, self._sqr_avg = var, sqr
            else:
                theta = self.adascale_smoothing
                self._var_avg = theta * self._var_avg + (1 - theta) * var
                self._sqr_avg = theta * self._sqr_avg + (1 - theta) * sqr
        ref = cast(int, self.ref_batch_size)
        if self._var_avg is None or self._sqr_avg is None or n == ref:
            return 1.0
        denominator = self._var_avg / n + self._sqr_avg
        if not denominator > 0.0:
            return 1.0
        gain = (self._var_avg / ref + self._sqr_avg) / denominator
        if not math.isfinite(gain):
            return 1.0
        low, high = sorted((1.0, n / ref))
        return min(max(gain, low), high)  # rounding must not take it past the bounds

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, unchanged, with the wrapper's own beside it under ``"torchfold"``.

        The wrapped optimizer loads it as it is (it ignores the extra key), and so does this wrapper.
        """
        if self._step_in_progress():
            raise RuntimeError(
                "state_dict() in the middle of a step would lose accumulated gradients; call it after step()"
            )
        return {
            **self.optimizer.state_dict(),
            "torchfold": {
                "lr_rule": self.lr_rule,
                "ref_batch_size": self.ref_batch_size,
                "reduction": self.reduction,
                "adascale_var_avg": self._var_avg,
                "adascale_sqr_avg": self._sqr_avg,
                "scale_invariant_steps": self.scale_invariant_steps,
                "steps": self.steps,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the rule, reference batch and reduction must match this wrapper.

        A plain optimizer's state dict (no ``"torchfold"`` key) restores the wrapped optimizer only.
        """
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            if isinstance(state_dict, dict) and set(state_dict) == {"optimizer", "torchfold"}:
                state_dict = {
                    **state_dict["optimizer"],
                    "torchfold": state_dict["torchfold"],
                }  # written by torchfold 0.1.0
            else:
                keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
                raise ValueError(
                    f"state_dict must come from AccumulatingOptimizer.state_dict() or an optimizer's state_dict() "
                    f"(keys 'state' and 'param_groups'), got {keys}"
                )
        inner = {key: value for key, value in state_dict.items() if key != "torchfold"}
        mine = state_dict.get("torchfold")
        if mine is not None:
            for key in ("lr_rule", "ref_batch_size", "reduction"):
                if mine[key] != getattr(self, key):
                    raise ValueError(
                        f"state_dict was saved with {key}={mine[key]!r} but this wrapper has {key}={getattr(self, key)!r}"
                    )
        self.optimizer.load_state_dict(inner)
        _own_xla_scalar_buffers(self.optimizer)
        if mine is not None:
            self._var_avg = mine["adascale_var_avg"]
            self._sqr_avg = mine["adascale_sqr_avg"]
            self.scale_invariant_steps = float(mine["scale_invariant_steps"])
            self.steps = int(mine["steps"])


def check_max_grad_norm(value: object) -> float | None:
    """``max_grad_norm`` as a float, or a ValueError/TypeError naming the rule and the value.

    >>> check_max_grad_norm(1), check_max_grad_norm(None)
    (1.0, None)
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"max_grad_norm must be a positive number or None, got {type(value).__name__} {value!r}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"max_grad_norm must be a positive finite number, got {value!r}")
    return float(value)


def _own_xla_scalar_buffers(optimizer: torch.optim.Optimizer) -> None:
    """Give each 0-dim state tensor of ``optimizer`` on an XLA device a device buffer of its own.

    torch_xla moves equal scalars to a device as one shared buffer (its scalar cache), so the step
    counts ``load_state_dict`` just loaded (all equal) are one buffer, named after the last. A step
    program captured over them takes one input for all, and its next capture, where they are separate,
    differs: a captured step would then be refused its replays. A computed copy of each is its
    own buffer; one small program, at load time rather than inside a step.
    """
    scalars = [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() == 0 and is_xla(value.device)
    ]
    if not scalars:
        return
    with torch.no_grad():
        for scalar in scalars:
            scalar.add_(0)
    xla_sync()
