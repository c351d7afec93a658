"""The deferred report: a step whose report waits until the next step is launched."""

from __future__ import annotations

import pytest

from torchfold.train.loop.deferral import DeferredReport


def test_a_held_step_is_reported_once_after_the_next_launch_and_at_the_end() -> None:
    reports: list[tuple[int, float | None, int | None]] = []
    deferred: DeferredReport[int] = DeferredReport(
        lambda step, until: reports.append((step, until, deferred.ahead))
    )
    with deferred.reporting_the_last():
        deferred.report(until=1.0)  # nothing held: nothing reported
        deferred.hold(0)
        deferred.report(until=2.0, ahead=1)  # step 1 launched: step 0 reported, step 1 ahead of it
        deferred.report(until=3.0, ahead=2)  # reported already: not again
        deferred.hold(1)
    assert reports == [(0, 2.0, 1), (1, None, None)]
    assert deferred.ahead is None


def test_a_failing_report_is_not_repeated_while_the_run_unwinds() -> None:
    seen: list[int] = []

    def report(step: int, until: float | None) -> None:
        seen.append(step)
        raise KeyError("on_step failed")

    deferred: DeferredReport[int] = DeferredReport(report)
    with pytest.raises(KeyError, match="on_step failed"), deferred.reporting_the_last():
        deferred.hold(0)
        deferred.report(until=None, ahead=1)
    assert seen == [0] and deferred.ahead is None


def test_a_step_held_when_the_run_fails_is_reported_and_the_failure_goes_on() -> None:
    seen: list[int] = []
    deferred: DeferredReport[int] = DeferredReport(lambda step, until: seen.append(step))
    with pytest.raises(RuntimeError, match="the next step failed"), deferred.reporting_the_last():
        deferred.hold(3)
        raise RuntimeError("the next step failed")
    assert seen == [3]
