"""AccumulatingOptimizer in one process: accumulation == one big batch, LR rules, AdaScale, checkpoints."""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from _dist_worker import make_model, mnist_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from torchfold.train.optim.optimizer import AccumulatingOptimizer, sample_weight

REF = 32
LR = 0.05
RULE_FACTORS = {
    "constant": lambda b: 1.0,
    "linear": lambda b: b / REF,
    "sqrt": lambda b: math.sqrt(b / REF),
}
# Each step: the minibatch sizes that make up its global batch (uneven ones included).
STEPS = [[16, 16, 16], [20, 20, 8], [64], [5, 30, 1, 12]]


def _batches(steps: list[list[int]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    x, y = mnist_rows()
    out, start = [], 0
    for sizes in steps:
        step = []
        for n in sizes:
            step.append((x[start : start + n], y[start : start + n]))
            start += n
        out.append(step)
    return out


def _plain_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    reduction: str = "mean",
) -> None:
    """The reference: one ordinary optimizer step on the whole global batch."""
    x = torch.cat([xb for xb, _ in step])
    y = torch.cat([yb for _, yb in step])
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad()
    F.cross_entropy(model(x), y, reduction=reduction).backward()
    opt.step()


@pytest.mark.parametrize("minibatch_size", [None, 16])
@pytest.mark.parametrize("rule", ["constant", "linear", "sqrt"])
@pytest.mark.parametrize(
    "make_opt",
    [lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9), lambda p: torch.optim.Adam(p, lr=LR)],
    ids=["sgd", "adam"],
)
def test_accumulated_minibatches_equal_one_big_batch(rule: str, make_opt, minibatch_size: int | None) -> None:
    model, ref_model = make_model(), make_model()
    opt = AccumulatingOptimizer(
        make_opt(model.parameters()),
        lr_rule=rule,  # type: ignore[arg-type]
        ref_batch_size=REF,
        minibatch_size=minibatch_size,
    )
    ref_opt = make_opt(ref_model.parameters())
    for step, sizes in zip(_batches(STEPS), STEPS, strict=True):
        for xb, yb in step:
            opt.backward(F.cross_entropy(model(xb), yb), num_samples=len(xb))
        opt.step()
        opt.zero_grad()
        batch = sum(sizes)
        assert opt.last_batch_size == batch and opt.last_num_minibatches == len(sizes)
        assert opt.last_lr_factor == pytest.approx(RULE_FACTORS[rule](batch))
        assert opt.param_groups[0]["lr"] == LR  # the reference LR is restored
        _plain_step(ref_model, ref_opt, step, LR * RULE_FACTORS[rule](batch))
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert any(
        not torch.equal(p, q) for p, q in zip(model.parameters(), make_model().parameters(), strict=True)
    )


def test_sum_reduction_equals_one_step_on_the_summed_loss() -> None:
    model, ref_model = make_model(), make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), reduction="sum")
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=1e-3)
    for step in _batches(STEPS):
        for xb, yb in step:
            opt.backward(F.cross_entropy(model(xb), yb, reduction="sum"), num_samples=len(xb))
        opt.step()
        opt.zero_grad()
        _plain_step(ref_model, ref_opt, step, 1e-3, reduction="sum")
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def _hand_adascale(
    model: torch.nn.Module, step: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[float, float]:
    """Per-sample gradient variance and squared mean-gradient norm, from the textbook formulas.

    Equal minibatches of b samples: the minibatch gradients' sample variance times b estimates the
    per-sample variance; |mean gradient|^2 minus the variance of the mean estimates |true gradient|^2.
    """
    grads = []
    for xb, yb in step:
        g = torch.autograd.grad(F.cross_entropy(model(xb), yb), list(model.parameters()))
        grads.append(torch.cat([t.reshape(-1) for t in g]))
    g = torch.stack(grads)
    m, b = len(step), len(step[0][0])
    mean = g.mean(0)
    minibatch_var = ((g - mean) ** 2).sum(1).sum() / (m - 1)
    var = float(minibatch_var * b)
    sqr = float(mean.pow(2).sum() - minibatch_var / m)
    return var, sqr


def test_adascale_gain_matches_a_hand_computation() -> None:
    model, ref_model = make_model(), make_model()
    opt = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        lr_rule="adascale",
        ref_batch_size=REF,
        adascale_smoothing=0.5,
    )
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=LR)
    averages: tuple[float, float] | None = None
    for step in _batches([[16] * 4, [16] * 6, [32] * 3]):
        var, sqr = _hand_adascale(ref_model, step)
        averages = (
            (var, sqr) if averages is None else (0.5 * averages[0] + 0.5 * var, 0.5 * averages[1] + 0.5 * sqr)
        )
        batch = sum(len(xb) for xb, _ in step)
        gain = (averages[0] / REF + averages[1]) / (averages[0] / batch + averages[1])
        for xb, yb in step:
            opt.backward(F.cross_entropy(model(xb), yb), num_samples=len(xb))
        opt.step()
        opt.zero_grad()
        assert opt.last_lr_factor == pytest.approx(gain, rel=1e-9)
        assert 1.0 < gain <= batch / REF
        _plain_step(ref_model, ref_opt, step, LR * gain)
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(p, q)
    assert opt.scale_invariant_steps > 3.0


def test_adascale_gain_does_not_depend_on_the_reduction() -> None:
    gains = {}
    for reduction in ("mean", "sum"):
        model = make_model()
        opt = AccumulatingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            lr_rule="adascale",
            ref_batch_size=REF,
            reduction=reduction,  # type: ignore[arg-type]
            adascale_smoothing=0.0,
        )
        for xb, yb in _batches([[16, 16, 8, 24]])[0]:  # uneven minibatches too
            opt.backward(F.cross_entropy(model(xb), yb, reduction=reduction), num_samples=len(xb))
        opt.step()
        gains[reduction] = opt.last_lr_factor
    assert gains["mean"] == pytest.approx(gains["sum"], rel=1e-9)
    assert 1.0 < gains["mean"] <= 64 / REF


def test_adascale_single_minibatch_gives_gain_one_without_nan() -> None:
    model = make_model()
    opt = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), lr_rule="adascale", ref_batch_size=REF
    )
    for sizes, expected in [([REF], 1.0), ([64], 1.0), ([REF, REF], None), ([REF], 1.0)]:
        for xb, yb in _batches([sizes])[0]:
            opt.backward(F.cross_entropy(model(xb), yb), num_samples=len(xb))
        opt.step()
        opt.zero_grad()
        assert math.isfinite(opt.last_lr_factor)
        if expected is not None:
            assert opt.last_lr_factor == expected
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_adascale_single_minibatch_after_history_uses_the_averages() -> None:
    model = make_model()
    opt = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-4), lr_rule="adascale", ref_batch_size=16
    )
    for sizes in ([16] * 4, [64]):
        for xb, yb in _batches([sizes])[0]:
            opt.backward(F.cross_entropy(model(xb), yb), num_samples=len(xb))
        opt.step()
        opt.zero_grad()
    assert 1.0 < opt.last_lr_factor <= 4.0  # one minibatch of 64 = 4x the reference batch


def test_scheduler_on_the_wrapper_keeps_working() -> None:
    model, ref_model = make_model(), make_model()
    opt = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), lr_rule="linear", ref_batch_size=REF
    )
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for i, (step, sizes) in enumerate(zip(_batches(STEPS), STEPS, strict=True)):
            for xb, yb in step:
                opt.backward(F.cross_entropy(model(xb), yb), num_samples=len(xb))
            opt.step()
            opt.zero_grad()
            scheduler.step()
            assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** (i + 1))
            _plain_step(ref_model, ref_opt, step, LR * 0.5**i * sum(sizes) / REF)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("rule", ["linear", "adascale"])
def test_state_dict_round_trip_resumes_exactly(rule: str) -> None:
    def run(model: torch.nn.Module, opt: AccumulatingOptimizer, batches: list) -> None:
        for step in batches:
            for xb, yb in step:
                opt.backward(F.cross_entropy(model(xb), yb), num_samples=len(xb))
            opt.step()
            opt.zero_grad()

    def new(model: torch.nn.Module) -> AccumulatingOptimizer:
        return AccumulatingOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), lr_rule=rule, ref_batch_size=REF
        )  # type: ignore[arg-type]

    steps = [[16, 16, 16], [8, 8], [16, 16, 16, 16], [32, 32]]
    full_model = make_model()
    full = new(full_model)
    run(full_model, full, _batches(steps))

    model = make_model()
    first = new(model)
    run(model, first, _batches(steps)[:2])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": first.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed_model = make_model(seed=1)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = new(resumed_model)
    resumed.load_state_dict(checkpoint["optimizer"])
    assert resumed.steps == 2
    run(resumed_model, resumed, _batches(steps)[2:])  # the same later minibatches as the full run
    assert resumed.scale_invariant_steps == pytest.approx(full.scale_invariant_steps)
    for p, q in zip(resumed_model.parameters(), full_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_parameters_without_gradients_are_left_out_of_the_update() -> None:
    model = make_model()
    unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = AccumulatingOptimizer(torch.optim.SGD([*model.parameters(), unused], lr=LR, weight_decay=0.1))
    for xb, yb in _batches([[16, 16]])[0]:
        opt.backward(F.cross_entropy(model(xb), yb), num_samples=len(xb))
    opt.step()
    assert unused.grad is None
    torch.testing.assert_close(unused.detach(), torch.ones(3, dtype=torch.float64))


def test_step_without_any_gradient_is_an_error_and_changes_nothing() -> None:
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    with pytest.raises(RuntimeError, match="step\\(\\) with no gradient from any rank"):
        opt.step()
    assert opt.steps == 0
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name])


def test_passes_through_param_groups_state_and_zero_grad() -> None:
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    opt = AccumulatingOptimizer(inner)
    assert opt.param_groups is inner.param_groups and opt.defaults is inner.defaults
    xb, yb = _batches([[8]])[0][0]
    opt.backward(F.cross_entropy(model(xb), yb), num_samples=8)
    assert all(p.grad is not None for p in model.parameters())  # gradients live in p.grad
    opt.step()
    assert opt.state is inner.state and len(opt.state) == 4
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_plain_backward_and_step_equal_the_wrapped_optimizer() -> None:
    model, ref_model = make_model(), make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=LR, momentum=0.9)
    for step in _batches(STEPS):
        x = torch.cat([xb for xb, _ in step])
        y = torch.cat([yb for _, yb in step])
        F.cross_entropy(model(x), y).backward()  # no sample count: used as it is
        opt.step()
        opt.zero_grad()
        _plain_step(ref_model, ref_opt, step, LR)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert opt.steps == len(STEPS)


def test_clipping_between_synchronize_and_step_equals_clipping_one_big_batch() -> None:
    model, ref_model = make_model(), make_model()
    opt = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), lr_rule="linear", ref_batch_size=REF
    )
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=LR)
    for step, sizes in zip(_batches(STEPS), STEPS, strict=True):
        for xb, yb in step:
            with opt.minibatch(len(xb)):
                F.cross_entropy(model(xb), yb).backward()
        opt.synchronize()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
        opt.step()
        opt.zero_grad()
        ref_norm = _clipped_big_batch_step(ref_model, ref_opt, step, sizes)
        torch.testing.assert_close(norm, ref_norm)
        assert norm > 0.1  # the clipping did something
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def _clipped_big_batch_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: list[tuple[torch.Tensor, torch.Tensor]],
    sizes: list[int],
) -> torch.Tensor:
    """The reference: one step on the step's minibatches as one batch, its gradient clipped to 0.1
    (the linear rule's rate set by hand); the norm before clipping."""
    x = torch.cat([xb for xb, _ in step])
    y = torch.cat([yb for _, yb in step])
    opt.param_groups[0]["lr"] = LR * sum(sizes) / REF
    F.cross_entropy(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    opt.step()
    opt.zero_grad()
    return norm


@pytest.mark.parametrize(
    "make_opt",
    [lambda p: torch.optim.SGD(p, lr=LR), lambda p: torch.optim.Adam(p, lr=LR)],
    ids=["sgd", "adam"],
)
def test_max_grad_norm_clips_the_steps_mean_gradient_as_clip_grad_norm_on_one_big_batch(make_opt) -> None:
    """max_grad_norm= clips after the all-reduce and the division, before the update: as
    clip_grad_norm_ on the gradient of one big batch, uneven minibatches included."""
    model, ref_model = make_model(), make_model()
    opt = AccumulatingOptimizer(
        make_opt(model.parameters()), lr_rule="linear", ref_batch_size=REF, max_grad_norm=0.1
    )
    ref_opt = make_opt(ref_model.parameters())
    for step, sizes in zip(_batches(STEPS), STEPS, strict=True):
        for xb, yb in step:
            with opt.minibatch(len(xb)):
                F.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        ref_norm = _clipped_big_batch_step(ref_model, ref_opt, step, sizes)
        assert opt.last_grad_norm is not None
        torch.testing.assert_close(opt.last_grad_norm, ref_norm)
        assert ref_norm > 0.1  # the clipping did something
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_a_grad_scaler_given_to_the_optimizer_unscales_clips_and_skips_as_the_manual_loop() -> None:
    """grad_scaler=: synchronize() unscales (then clips), step() skips an overflowed update and
    updates the scale: the same as scaler.unscale_ / clip_grad_norm_ / scaler.step by hand."""
    model, ref_model = make_model().float(), make_model().float()
    opt = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), max_grad_norm=0.5, grad_scaler=torch.amp.GradScaler("cpu")
    )
    ref_opt = AccumulatingOptimizer(torch.optim.SGD(ref_model.parameters(), lr=LR))
    ref_scaler = torch.amp.GradScaler("cpu")
    for number, step in enumerate(_batches(STEPS)):
        boost = 2.0**127 if number == 1 else 1.0  # step 1 overflows: skipped by both
        for xb, yb in step:
            with opt.minibatch(len(xb)):
                assert opt.grad_scaler is not None
                opt.grad_scaler.scale(F.cross_entropy(model(xb.float()), yb) * boost).backward()
            with ref_opt.minibatch(len(xb)):
                ref_scaler.scale(F.cross_entropy(ref_model(xb.float()), yb) * boost).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.synchronize()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=0.5)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        assert opt.grad_scaler.get_scale() == ref_scaler.get_scale()
    assert ref_scaler.get_scale() < 2.0**16  # the overflow lowered the scale
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_computed_step_refuses_to_skip_clipping_or_loss_scaling() -> None:
    """A runner that computes the step itself must clip (clipped=True); loss scaling it cannot do."""
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR), max_grad_norm=1.0)
    with pytest.raises(RuntimeError, match=r"max_grad_norm=1.0: .* does not clip it"):
        opt.computed_step(lambda lrs: None, num_samples=4, num_minibatches=1)
    assert opt.steps == 0
    opt.computed_step(lambda lrs: None, num_samples=4, num_minibatches=1, clipped=True)
    assert opt.steps == 1
    opt.grad_scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="with a grad_scaler"):
        opt.computed_step(lambda lrs: None, num_samples=4, num_minibatches=1, clipped=True)
    for bad, error in ((0.0, ValueError), (math.inf, ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_grad_norm must be"):
            AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR), max_grad_norm=bad)


def test_the_weighting_rule_makes_the_mean_over_the_step_however_it_is_split() -> None:
    """sample_weight: minibatch gradients weighted by it and divided once by the step's weight give
    the gradient of the mean (or summed) loss over all the step's samples, in any unit; the loss
    sum over the step's weight is the mean loss."""
    model = make_model()
    x, y = mnist_rows()
    x, y = x[:10], y[:10]
    sizes = [3, 6, 1]
    for reduction in ("mean", "sum"):
        whole = torch.autograd.grad(
            F.cross_entropy(model(x), y, reduction=reduction), list(model.parameters())
        )
        for unit in (1.0, 4.0):
            summed = [torch.zeros_like(p) for p in model.parameters()]
            loss_sum = 0.0
            for xb, yb in zip(x.split(sizes), y.split(sizes), strict=True):
                loss = F.cross_entropy(model(xb), yb, reduction=reduction)
                grads = torch.autograd.grad(loss, list(model.parameters()))
                for acc, grad in zip(summed, grads, strict=True):
                    acc += grad * sample_weight(len(xb), reduction, unit)
                loss_sum += float(loss.detach()) * sample_weight(len(xb), reduction)
            for acc, want in zip(summed, whole, strict=True):
                torch.testing.assert_close(acc / sample_weight(len(x), reduction, unit), want)
            full = float(F.cross_entropy(model(x), y, reduction=reduction).detach())
            assert loss_sum / sample_weight(len(x), reduction) == pytest.approx(full)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        sample_weight(3, "none")


@pytest.mark.parametrize("rule", ["constant", "linear"])
def test_a_computed_update_after_minibatches_equals_step(rule: str) -> None:
    """computed_step(run) without counts: the minibatches' gradients synchronized, then run(lrs)
    with the rule's rates (in the param groups too while it runs), the step counted as step() does."""
    results = []
    for computed in (False, True):
        torch.manual_seed(0)
        model = make_model()
        opt = AccumulatingOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
            lr_rule=rule,
            ref_batch_size=REF,  # type: ignore[arg-type]
        )
        seen: list[tuple[list[float], list[float]]] = []

        def run(lrs: list[float], opt: AccumulatingOptimizer = opt, seen: list = seen) -> str:
            seen.append((lrs, [group["lr"] for group in opt.param_groups]))
            opt.optimizer.step()
            return "ran"

        for step in _batches(STEPS):
            for xb, yb in step:
                opt.backward(F.cross_entropy(model(xb), yb), num_samples=len(xb))
            if computed:
                assert opt.computed_step(run) == "ran"
            else:
                opt.step()
            opt.zero_grad()
        if computed:
            factors = [RULE_FACTORS[rule](sum(sizes)) for sizes in STEPS]
            assert seen == [([LR * f], [LR * f]) for f in factors]
        assert opt.param_groups[0]["lr"] == LR and opt.steps == len(STEPS)
        results.append(
            (opt.last_batch_size, opt.last_lr_factor, [p.detach().clone() for p in model.parameters()])
        )
    (size, factor, params), (size_c, factor_c, params_c) = results
    assert (size, factor) == (size_c, factor_c)
    for p, q in zip(params, params_c, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_computed_step_takes_both_counts_or_neither_and_only_between_steps() -> None:
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(ValueError, match=r"num_samples=4, num_minibatches=None\): give both"):
        opt.computed_step(lambda lrs: None, num_samples=4)
    x, y = mnist_rows()
    opt.backward(F.cross_entropy(model(x[:4]), y[:4]), num_samples=4)
    with pytest.raises(
        RuntimeError, match=r"in the middle of a step; call it after step\(\) and zero_grad\(\)"
    ):
        opt.computed_step(lambda lrs: None, num_samples=4, num_minibatches=1)
    assert opt.steps == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_grad_scaler_with_autocast_on_cpu_matches_one_big_batch(dtype: torch.dtype) -> None:
    def new() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(784, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))

    model, ref_model = new(), new()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=LR)
    scaler, ref_scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for step in _batches(STEPS):
        for xb, yb in step:
            with opt.minibatch(len(xb)):
                with torch.autocast("cpu", dtype=dtype):
                    loss = F.cross_entropy(model(xb.float()), yb)
                scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        x = torch.cat([xb for xb, _ in step]).float()
        y = torch.cat([yb for _, yb in step])
        with torch.autocast("cpu", dtype=dtype):
            ref_loss = F.cross_entropy(ref_model(x), y)
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=1.0)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
    assert scaler.get_scale() == ref_scaler.get_scale()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0.02, atol=2e-3)  # low-precision matmuls summed in other orders


def test_a_step_skipped_by_the_grad_scaler_leaves_weights_and_the_next_step_works() -> None:
    model = make_model().float()
    before = copy.deepcopy(model.state_dict())
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # times the loss: overflows float32
    xb, yb = _batches([[8]])[0][0]
    with opt.minibatch(8):
        scaler.scale(F.cross_entropy(model(xb.float()), yb) * 1e3).backward()
    opt.synchronize()
    scaler.step(opt)  # finds inf and skips optimizer.step()
    scaler.update()
    opt.zero_grad()
    assert opt.steps == 0 and scaler.get_scale() < 2.0**127
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name])
    with opt.minibatch(8):
        F.cross_entropy(model(xb.float()), yb).backward()
    opt.step()
    assert opt.steps == 1 and opt.last_batch_size == 8


def test_stray_and_mixed_backwards_are_errors() -> None:
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    xb, yb = _batches([[4]])[0][0]
    F.cross_entropy(model(xb), yb).backward()  # a stray plain backward...
    with pytest.raises(RuntimeError, match=r"outside optimizer\.minibatch"):
        opt.backward(F.cross_entropy(model(xb), yb), num_samples=4)  # ...before a weighted one
    opt.zero_grad()
    opt.backward(F.cross_entropy(model(xb), yb), num_samples=4)
    with pytest.raises(RuntimeError, match=r"outside optimizer\.minibatch"):
        F.cross_entropy(model(xb), yb).backward()  # and after one
    opt.zero_grad()
    linear = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), lr_rule="linear", ref_batch_size=4
    )
    F.cross_entropy(model(xb), yb).backward()
    with pytest.raises(RuntimeError, match="lr_rule='linear' needs the step's sample count"):
        linear.step()


def test_state_dict_is_the_inner_optimizers_with_the_wrappers_beside_it() -> None:
    model = make_model()
    inner = torch.optim.Adam(model.parameters(), lr=LR)
    opt = AccumulatingOptimizer(inner, lr_rule="sqrt", ref_batch_size=REF)
    xb, yb = _batches([[8]])[0][0]
    opt.backward(F.cross_entropy(model(xb), yb), num_samples=8)
    opt.step()
    state = opt.state_dict()
    plain = inner.state_dict()
    assert set(state) == {*plain, "torchfold"} and state["torchfold"]["steps"] == 1
    assert state["param_groups"] == plain["param_groups"]
    fresh = torch.optim.Adam(make_model().parameters(), lr=LR)
    fresh.load_state_dict(state)  # the wrapped optimizer's kind loads it as it is
    torch.testing.assert_close(fresh.state_dict()["state"], plain["state"])
    other = AccumulatingOptimizer(
        torch.optim.Adam(make_model().parameters(), lr=LR), lr_rule="sqrt", ref_batch_size=REF
    )
    other.load_state_dict(plain)  # and the wrapper loads a plain optimizer's state
    assert other.steps == 0
    other.load_state_dict(state)
    assert other.steps == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr_rule": "cubic"}, ValueError, "lr_rule must be one of"),
        ({"lr_rule": "linear"}, ValueError, "pass ref_batch_size="),
        (
            {"lr_rule": "sqrt", "ref_batch_size": 0},
            ValueError,
            "ref_batch_size must be a positive int, got 0",
        ),
        ({"ref_batch_size": True}, TypeError, "ref_batch_size must be an int, got bool True"),
        ({"reduction": "max"}, ValueError, "reduction must be 'mean' or 'sum'"),
        ({"adascale_smoothing": 1.0}, ValueError, r"adascale_smoothing must be in \[0, 1\)"),
        ({"module": "model"}, TypeError, "module must be a torch.nn.Module"),
        ({"minibatch_size": 0}, ValueError, "minibatch_size must be a positive int, got 0"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        AccumulatingOptimizer(torch.optim.SGD(make_model().parameters(), lr=LR), **kwargs)


def test_misuse_is_rejected() -> None:
    model = make_model()
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer"):
        AccumulatingOptimizer(model)  # type: ignore[arg-type]
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(TypeError, match="already an AccumulatingOptimizer"):
        AccumulatingOptimizer(opt)
    xb, yb = _batches([[4]])[0][0]
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        opt.backward(F.cross_entropy(model(xb), yb), num_samples=0)
    opt.backward(F.cross_entropy(model(xb), yb), num_samples=4)
    with pytest.raises(RuntimeError, match="in the middle of a step"):
        opt.state_dict()
    opt.step()
    with pytest.raises(RuntimeError, match=r"call optimizer.zero_grad\(\) after optimizer.step\(\)"):
        opt.backward(F.cross_entropy(model(xb), yb), num_samples=4)
    opt.zero_grad()
    other = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), lr_rule="linear", ref_batch_size=8
    )
    with pytest.raises(
        ValueError, match="saved with lr_rule='constant' but this wrapper has lr_rule='linear'"
    ):
        other.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="keys 'state' and 'param_groups'"):
        other.load_state_dict({"model": {}})


class _FineTuned(torch.nn.Module):
    """make_model() plus a logit offset: a parameter that joins the optimizer as a group of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.offset = torch.nn.Parameter(torch.linspace(-0.5, 0.5, 10, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.offset


def _fine_tuning_setup(
    wrap: bool,
) -> tuple[_FineTuned, torch.optim.Optimizer, torch.optim.Optimizer]:
    """The first layer frozen when the optimizer is made and unfrozen later; the offset added as a group."""
    model = _FineTuned()
    first = model.body[0]
    first.requires_grad_(False)
    inner = torch.optim.SGD(model.body.parameters(), lr=LR, momentum=0.9)
    opt: torch.optim.Optimizer = AccumulatingOptimizer(inner) if wrap else inner
    first.requires_grad_(True)  # unfrozen after the optimizer exists (usual fine-tuning)
    inner.add_param_group({"params": [model.offset], "lr": 2 * LR})  # on the wrapped optimizer itself
    return model, opt, inner


@settings(max_examples=15, deadline=None)
@given(steps=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=3))
def test_accumulation_equals_one_big_batch_for_unfrozen_parameters_and_added_groups(
    steps: list[list[int]],
) -> None:
    model, opt, _ = _fine_tuning_setup(wrap=True)
    ref_model, ref_opt, _ = _fine_tuning_setup(wrap=False)
    for step in _batches(steps):
        for xb, yb in step:
            opt.backward(F.cross_entropy(model(xb), yb), num_samples=len(xb))  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad()
        x = torch.cat([xb for xb, _ in step])
        y = torch.cat([yb for _, yb in step])
        ref_opt.zero_grad()
        F.cross_entropy(ref_model(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")


def test_autograd_grad_is_untouched_inside_and_outside_minibatch() -> None:
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    params = list(model.parameters())
    (xb, yb), (xc, yc) = _batches([[5, 7]])[0]
    true = torch.autograd.grad(F.cross_entropy(model(xb), yb), params)
    with opt.minibatch(5):
        inside = torch.autograd.grad(F.cross_entropy(model(xb), yb), params)
        F.cross_entropy(model(xb), yb).backward()
    for g, t in zip(inside, true, strict=True):
        torch.testing.assert_close(g, t)  # not 5 times it
    outside = torch.autograd.grad(F.cross_entropy(model(xc), yc), params)  # not taken for a plain backward
    with opt.minibatch(7):
        F.cross_entropy(model(xc), yc).backward()
    opt.synchronize()
    assert opt.last_batch_size == 12 and opt.last_num_minibatches == 2
    expected = [
        (5 * a + 7 * b) / 12
        for a, b in zip(true, torch.autograd.grad(F.cross_entropy(model(xc), yc), params), strict=True)
    ]
    for p, e, o in zip(params, expected, outside, strict=True):
        torch.testing.assert_close(p.grad, e)
        torch.testing.assert_close(o, torch.autograd.grad(F.cross_entropy(model(xc), yc), [p])[0])


def test_a_replaced_gradient_accumulator_is_refused_then_rehooked() -> None:
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    model.float()  # after the optimizer: each parameter gets a new gradient accumulator
    xb, yb = _batches([[4]])[0][0]
    with pytest.raises(RuntimeError, match=r"gradient accumulator was replaced.*create the optimizer after"):
        opt.backward(F.cross_entropy(model(xb.float()), yb), num_samples=4)
    opt.zero_grad()
    ref = copy.deepcopy(model)
    opt.backward(F.cross_entropy(model(xb.float()), yb), num_samples=4)
    opt.synchronize()
    F.cross_entropy(ref(xb.float()), yb).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("skip", ["grad_scaler", "non_finite_clip_norm"])
def test_adascale_recovers_from_a_skipped_non_finite_step(skip: str) -> None:
    model = make_model().float()
    opt = AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3), lr_rule="adascale", ref_batch_size=16
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    steps = _batches([[16] * 4, [16] * 4, [16] * 4])

    def run(step: list[tuple[torch.Tensor, torch.Tensor]], blow_up: bool) -> bool:
        """One step; True if it was skipped."""
        for xb, yb in step:
            with opt.minibatch(len(xb)):
                loss = F.cross_entropy(model(xb.float()), yb) * (math.inf if blow_up else 1.0)
                (scaler.scale(loss) if skip == "grad_scaler" else loss).backward()
        opt.synchronize()
        if skip == "grad_scaler":
            scaler.step(opt)  # finds inf: skips optimizer.step()
            scaler.update()
            skipped = opt.steps == done
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            skipped = not torch.isfinite(norm)
            if not skipped:
                opt.step()
        opt.zero_grad()
        return skipped

    done = 0
    assert not run(steps[0], blow_up=False)
    done = opt.steps
    averages = (opt._var_avg, opt._sqr_avg)
    assert all(a is not None and math.isfinite(a) for a in averages)
    assert run(steps[1], blow_up=True)
    assert (opt._var_avg, opt._sqr_avg) == averages  # the skipped step left them alone
    assert 1.0 <= opt.last_lr_factor <= 64 / 16
    assert not run(steps[2], blow_up=False)
    assert math.isfinite(opt._var_avg) and math.isfinite(opt._sqr_avg)  # type: ignore[arg-type]
    assert 1.0 <= opt.last_lr_factor <= 64 / 16
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_group_added_mid_step_with_unweighted_gradients_is_refused() -> None:
    model = _FineTuned()
    inner = torch.optim.SGD(model.body.parameters(), lr=LR)
    opt = AccumulatingOptimizer(inner)
    (xb, yb), (xc, yc) = _batches([[5, 7]])[0]
    opt.backward(F.cross_entropy(model(xb), yb), num_samples=5)  # model.offset's gradient: not weighted
    inner.add_param_group({"params": [model.offset]})
    with pytest.raises(RuntimeError, match=r"shapes \[\(10,\)\] got gradients in this step before they were"):
        opt.backward(F.cross_entropy(model(xc), yc), num_samples=7)


@pytest.mark.parametrize("on", ["wrapper", "wrapped optimizer"])
def test_a_group_added_between_steps_starts_from_that_steps_gradient(on: str) -> None:
    # A head outside the optimizer collects gradients that zero_grad() does not clear; unfrozen
    # with add_param_group after step 1 (as the mid-step error advises), its first update used
    # that stale, unweighted sum. It must equal a head that was in the optimizer with lr 0.
    batches = _batches([[5, 7], [3, 6]])

    def train(head_from_start: bool) -> torch.Tensor:
        model = _FineTuned()
        inner = torch.optim.SGD(model.body.parameters(), lr=LR)
        opt = AccumulatingOptimizer(inner)
        if head_from_start:
            opt.add_param_group({"params": [model.offset], "lr": 0.0})
        for number, step in enumerate(batches):
            if number == 1:
                if head_from_start:
                    opt.param_groups[-1]["lr"] = LR
                else:
                    (opt if on == "wrapper" else inner).add_param_group({"params": [model.offset], "lr": LR})
            for xb, yb in step:
                opt.backward(F.cross_entropy(model(xb), yb), num_samples=len(xb))
            opt.step()
            opt.zero_grad()
        return model.offset.detach()

    torch.testing.assert_close(train(head_from_start=False), train(head_from_start=True))


def test_a_default_minibatch_size_holds_only_inside_and_only_where_none_is_set() -> None:
    model = torch.nn.Linear(3, 1)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with opt.default_minibatch_size(4):
        assert opt.minibatch_unit() == 4.0
        with opt.minibatch(4):  # a full minibatch: weight 1
            F.mse_loss(model(torch.ones(4, 3)), torch.zeros(4, 1)).backward()
        opt.step()
        opt.zero_grad()
    assert opt.minibatch_size is None and opt.minibatch_unit() == 1.0
    opt.minibatch_size = 2  # the user's setting wins
    with opt.default_minibatch_size(4):
        assert opt.minibatch_unit() == 2.0
    with pytest.raises(ValueError, match="minibatch_size must be a positive int, got 0"):
        opt.default_minibatch_size(0).__enter__()


def test_step_calls_a_closure_once_first_and_returns_its_result() -> None:
    """Lightning's manual optimization passes ``optimizer.step()`` a closure (its hooks), always:
    ``step()`` once refused any closure, so no Lightning loop could step. The step is the same as
    without one; the closure runs before the update, with gradients enabled."""
    calls: list[bool] = []

    def closure() -> float:
        calls.append(torch.is_grad_enabled())
        return 7.0

    results = []
    for passed in (None, closure):
        torch.manual_seed(0)
        model = make_model()
        opt = AccumulatingOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR), lr_rule="linear", ref_batch_size=4
        )
        for xb, yb in _batches([[4, 2]])[0]:
            with opt.minibatch(len(xb)):
                F.cross_entropy(model(xb), yb).backward()
        with torch.no_grad():
            returned = opt.step(passed)
        assert returned == (None if passed is None else 7.0)
        results.append([p.detach().clone() for p in model.parameters()])
    assert calls == [True]
    for p, q in zip(*results, strict=True):
        assert torch.equal(p, q)
