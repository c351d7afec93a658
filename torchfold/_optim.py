"""An optimizer wrapper for steps made of a varying number of minibatches, with learning-rate rules.

Semantics (``reduction="mean"``): a step whose global batch of ``B`` samples is split into ``m``
minibatches, spread over the ranks in any way (a rank may have none), updates the parameters
exactly like one step of the wrapped optimizer on the mean loss over the ``B`` samples, with the
learning rate multiplied by the rule's factor. Minibatches may differ in size: minibatch ``i``
with ``n_i`` samples and mean-loss gradient ``g_i`` contributes ``n_i * g_i``, and the summed
gradient is divided once, by ``B = sum(n_i)`` counted over all ranks. With ``reduction="sum"``
(losses summed over samples) the gradients are summed and not divided: one step on the summed
loss over the ``B`` samples. That division (in :meth:`AccumulatingOptimizer.step`) is the only
place where gradients are scaled; the user's loss is used as it is.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
from torch.nn.parallel import DistributedDataParallel

from torchfold._distributed import all_reduce_sum_, xla_sync
from torchfold._trace import scaled_lr

__all__ = ["AccumulatingOptimizer"]

# The trace module's rules (constant, linear, sqrt: scaled_lr) plus AdaScale, which needs gradients.
_LRRuleName = Literal["constant", "linear", "sqrt", "adascale"]
_LR_RULES: tuple[_LRRuleName, ...] = ("constant", "linear", "sqrt", "adascale")

# Stats that ride along with the gradients in the same all-reduce.
_SAMPLES, _MINIBATCHES, _WEIGHTED_SQNORM = 0, 1, 2
_N_STATS = 3


class AccumulatingOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer so that each step accumulates any number of minibatches and all-reduces once.

    The loop stays ordinary: for each minibatch of this rank in the current step, compute the loss
    and call :meth:`backward`; then call :meth:`step` once per step on every rank (also on a rank
    that had no minibatch in this step: it contributes zero gradients and still joins the
    all-reduce, so nothing hangs), then :meth:`zero_grad`.

    The learning rate in ``param_groups`` stays the reference learning rate: :meth:`step` multiplies
    it by the rule's factor for the update only and restores it, so LR schedulers attached to this
    wrapper (or to the wrapped optimizer) keep working. With global batch ``B`` and reference batch
    ``R``, the factor is 1 (``"constant"``), ``B / R`` (``"linear"``), ``sqrt(B / R)`` (``"sqrt"``),
    or the AdaScale gain (``"adascale"``, Johnson et al. 2020)::

        gain = (var / R + sqr) / (var / B + sqr)

    where ``var`` is the per-sample gradient variance (trace of the covariance) and ``sqr`` the
    squared norm of the true gradient, both estimated from the spread of this step's
    per-minibatch gradients (each minibatch's own gradient, measured in :meth:`backward` before it
    joins the sum) and smoothed over steps with ``adascale_smoothing``. The gain is 1 when
    ``B == R``, lies between 1 and ``B / R``, and stays 1 (never NaN) until some step has had at
    least two minibatches to estimate the variance from.

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
        adascale_smoothing: weight of the past in the exponential moving averages of AdaScale's
            variance estimates, in ``[0, 1)`` (default 0.9; 0 uses each step's estimate alone).

    >>> model = torch.nn.Linear(3, 1)
    >>> opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                             lr_rule="linear", ref_batch_size=4)
    >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
    >>> for xb, yb in zip(x.split(3), y.split(3)):  # minibatches of 3, 3 and 2 samples
    ...     opt.backward(torch.nn.functional.mse_loss(model(xb), yb), num_samples=len(xb))
    >>> opt.step()  # one update on the mean loss over the 8 samples, lr 0.1 * 8 / 4
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
    ) -> None:
        # torch.optim.Optimizer.__init__ is deliberately not called: the wrapped optimizer owns the
        # parameter groups and state; this class only forwards to it (schedulers need the isinstance).
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, AccumulatingOptimizer):
            raise TypeError("optimizer is already an AccumulatingOptimizer; wrap the plain optimizer once")
        if lr_rule not in _LR_RULES:
            raise ValueError(f"lr_rule must be one of {list(_LR_RULES)}, got {lr_rule!r}")
        if ref_batch_size is not None and (
            isinstance(ref_batch_size, bool) or not isinstance(ref_batch_size, int) or ref_batch_size < 1
        ):
            raise ValueError(f"ref_batch_size must be a positive int, got {ref_batch_size!r}")
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
        # Accumulated (weighted) gradient sums, one per parameter, and this step's local stats.
        self._acc: list[torch.Tensor | None] = []
        self._local_samples = 0
        self._local_minibatches = 0
        self._local_sqnorm: torch.Tensor | None = None
        # AdaScale's smoothed estimates and progress; part of state_dict().
        self._var_avg: float | None = None
        self._sqr_avg: float | None = None
        self.scale_invariant_steps = 0.0
        self.steps = 0
        self.last_batch_size = 0
        self.last_num_minibatches = 0
        self.last_lr_factor = 1.0
        self._stepped_grads: list[weakref.ref[torch.Tensor]] = []

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
        """Add a parameter group to the wrapped optimizer (only between steps)."""
        if self._local_minibatches:
            raise RuntimeError("add_param_group() in the middle of a step; call it after step()")
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' ``.grad`` (the wrapper's accumulated sums are cleared by :meth:`step`)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

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

    def backward(self, loss: torch.Tensor, num_samples: int) -> None:
        """Backpropagate one minibatch's loss and add its gradient to this step's sum.

        Call it once per minibatch, on the loss of that minibatch alone (for ``reduction="mean"``:
        averaged over its ``num_samples`` samples, as ``torch.nn.functional`` losses do by
        default). ``.grad`` is emptied afterwards; the sum is kept by the wrapper until :meth:`step`.

        Args:
            loss: a scalar loss of this minibatch.
            num_samples: how many samples the minibatch has (its share of the global batch).
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(
                f"num_samples must be a positive int (the minibatch's sample count), got {num_samples!r}"
            )
        if isinstance(self.module, DistributedDataParallel) and self.module.require_backward_grad_sync:
            raise RuntimeError(
                "the DistributedDataParallel module is no longer in no_sync() mode (close() was called or "
                "someone re-enabled it); its own all-reduce would hang ranks with fewer minibatches"
            )
        params = self._params()
        if not self._local_minibatches and any(
            ref() is not None and ref() is p.grad for ref, p in zip(self._stepped_grads, params, strict=False)
        ):
            raise RuntimeError(
                "the parameters still hold the gradients of the previous step; call optimizer.zero_grad() after "
                "optimizer.step(), before the next step's first backward()"
            )
        loss.backward()
        if len(self._acc) != len(params):
            if self._local_minibatches:
                raise RuntimeError("the parameter groups changed in the middle of a step")
            self._acc = [None] * len(params)
        weight = float(num_samples) if self.reduction == "mean" else 1.0
        sqnorm: torch.Tensor | None = None
        with torch.no_grad():
            for i, p in enumerate(params):
                g = p.grad
                if g is None:
                    continue
                if self.lr_rule == "adascale":
                    s = g.detach().pow(2).sum()
                    sqnorm = s if sqnorm is None else sqnorm + s
                acc = self._acc[i]
                self._acc[i] = g.detach() * weight if acc is None else acc.add_(g.detach(), alpha=weight)
                p.grad = None
        if sqnorm is not None:
            # n_i * |mean-loss gradient|^2, whatever the reduction (see _adascale_gain).
            scale = float(num_samples) if self.reduction == "mean" else 1.0 / num_samples
            term = sqnorm * scale
            self._local_sqnorm = term if self._local_sqnorm is None else self._local_sqnorm + term
        self._local_samples += num_samples
        self._local_minibatches += 1
        if loss.device.type == "xla":
            # One lazy graph per minibatch: compiled once and reused however many minibatches a
            # step has, instead of one new graph per distinct count.
            xla_sync()

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """End the step: all-reduce the summed gradients, scale them once, update with the rule's LR.

        Every rank must call it once per step, also a rank without minibatches in this step.
        """
        if closure is not None:
            raise TypeError("AccumulatingOptimizer.step() takes no closure; call backward() per minibatch")
        params = self._params()
        if not params:
            return
        if len(self._acc) != len(params):
            self._acc = [None] * len(params)
        device = params[0].device
        stats_dtype = torch.float32 if device.type in ("xla", "mps") else torch.float64
        stats = torch.zeros(_N_STATS + len(params), dtype=stats_dtype, device=device)
        stats[_SAMPLES] = self._local_samples
        stats[_MINIBATCHES] = self._local_minibatches
        if self._local_sqnorm is not None:
            stats[_WEIGHTED_SQNORM] = self._local_sqnorm.to(device=device, dtype=stats_dtype)
        grads: list[torch.Tensor] = []
        for i, (p, acc) in enumerate(zip(params, self._acc, strict=True)):
            if acc is not None:
                stats[_N_STATS + i] = 1.0
            grads.append(acc if acc is not None else torch.zeros_like(p))
        all_reduce_sum_([*grads, stats])
        totals = stats.tolist()
        num_samples, num_minibatches = round(totals[_SAMPLES]), round(totals[_MINIBATCHES])
        self._acc = [None] * len(params)
        self._local_samples = self._local_minibatches = 0
        self._local_sqnorm = None
        if num_minibatches == 0:
            return  # no rank had data in this step: nothing to learn from, nothing to update
        with torch.no_grad():
            if self.lr_rule == "adascale":
                total = torch.stack([g.to(stats_dtype).pow(2).sum() for g in grads]).sum()
                grad_sqnorm = float(total) / num_samples**2
                factor = self._adascale_gain(
                    num_samples, num_minibatches, totals[_WEIGHTED_SQNORM], grad_sqnorm
                )
            else:
                factor = self._rule_factor(num_samples)
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                if totals[_N_STATS + i] == 0:
                    p.grad = None  # no rank produced a gradient for it: leave it out of the update
                    continue
                if self.reduction == "mean":
                    g.div_(num_samples)  # the one place where gradients are scaled
                p.grad = g
        ref_lrs = [group["lr"] for group in self.optimizer.param_groups]
        try:
            for group, lr in zip(self.optimizer.param_groups, ref_lrs, strict=True):
                group["lr"] = lr * factor
            self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, ref_lrs, strict=True):
                group["lr"] = lr
        self._stepped_grads = [weakref.ref(g) for g in grads]
        self.steps += 1
        self.scale_invariant_steps += factor if self.lr_rule == "adascale" else 1.0
        self.last_batch_size = num_samples
        self.last_num_minibatches = num_minibatches
        self.last_lr_factor = factor

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
        leaves them unchanged.
        """
        if m > 1:
            var = max((weighted_sqnorm - n * grad_sqnorm) / (m - 1), 0.0)
            sqr = max(grad_sqnorm - var / n, 0.0)
            if self._var_avg is None or self._sqr_avg is None:
                self._var_avg, self._sqr_avg = var, sqr
            else:
                theta = self.adascale_smoothing
                self._var_avg = theta * self._var_avg + (1 - theta) * var
                self._sqr_avg = theta * self._sqr_avg + (1 - theta) * sqr
        ref = cast(int, self.ref_batch_size)
        if self._var_avg is None or self._sqr_avg is None or n == ref:
            return 1.0
        denominator = self._var_avg / n + self._sqr_avg
        if denominator <= 0.0:
            return 1.0
        return (self._var_avg / ref + self._sqr_avg) / denominator

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus the wrapper's own (rule, AdaScale averages, counters)."""
        if self._local_minibatches:
            raise RuntimeError(
                "state_dict() in the middle of a step would lose accumulated gradients; call it after step()"
            )
        return {
            "optimizer": self.optimizer.state_dict(),
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
        """Restore a :meth:`state_dict`; the rule, reference batch and reduction must match this wrapper."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"optimizer", "torchfold"}:
            raise ValueError(
                "state_dict must come from AccumulatingOptimizer.state_dict() (keys 'optimizer' and 'torchfold'); "
                "to load a plain optimizer's state, call .optimizer.load_state_dict()"
            )
        mine = state_dict["torchfold"]
        for key in ("lr_rule", "ref_batch_size", "reduction"):
            if mine[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict was saved with {key}={mine[key]!r} but this wrapper has {key}={getattr(self, key)!r}"
                )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._var_avg = mine["adascale_var_avg"]
        self._sqr_avg = mine["adascale_sqr_avg"]
        self.scale_invariant_steps = float(mine["scale_invariant_steps"])
        self.steps = int(mine["steps"])
