"""Tests for torchfold.train.schedule.trace: parsing, validation, epochs, conversion, schedules, plots."""

from __future__ import annotations

import itertools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchfold.train.optim.lr import scaled_lr
from torchfold.train.schedule.trace import BatchSizeTrace, EpochSteps, as_trace


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# -- reading CSV files --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "sizes"),
    [
        ("step,batchsize\n0,32\n1,64\n", (32, 64)),
        ("0,32\n1,64\n", (32, 64)),  # header optional
        (" step , batchsize \n 0, 1024\n 1 ,  512 \n", (1024, 512)),  # spaces
        ("STEP,BatchSize\r\n0,8\r\n1,8\r\n", (8, 8)),  # CRLF, header case
        ("\ufeffstep,batchsize\n0,8\n", (8,)),  # byte-order mark
        ("step,batchsize\n\n0,8\n\n1,16\n\n", (8, 16)),  # blank lines
        ("step,batchsize\n0,8\n1,8\n0,16\n1,16\n2,16", (8, 8, 16, 16, 16)),  # restart: a new segment
    ],
)
def test_from_csv_reads(tmp_path: Path, text: str, sizes: tuple[int, ...]) -> None:
    trace = BatchSizeTrace.from_csv(write(tmp_path, text))
    assert trace.batch_sizes == sizes
    assert trace.num_steps == len(sizes)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("step,batchsize\n0,32\n1,3.5\n", "line 3: batch size should be an integer, got '3.5'"),
        ("step,batchsize\n0,32\n1,abc\n", "line 3: batch size should be an integer, got 'abc'"),
        ("step,batchsize\n0,32\n1,\n", "line 3: batch size should be an integer, got ''"),
        ("step,batchsize\nx,32\n", "line 2: step should be an integer, got 'x'"),
        ("step,batchsize\n0,32\n1,0\n", "line 3: batch size should be positive, got 0"),
        ("step,batchsize\n0,-64\n", "line 2: batch size should be positive, got -64"),
        ("step,batchsize\n0,32\n1,32\n1,32\n", "line 4: repeated step 1; expected step 2"),
        ("step,batchsize\n0,32\n2,32\n", "line 3: missing step 1 before step 2"),
        ("step,batchsize\n0,32\n1,32\n5,32\n", "line 4: missing steps 2..4 before step 5"),
        ("step,batchsize\n1,32\n", "line 2: missing step 0 before step 1"),
        ("step,batchsize\n0,32,7\n", "line 2: expected 2 fields 'step,batchsize', got 3"),
        ("step,batchsize\n0\n", "line 2: expected 2 fields 'step,batchsize', got 1"),
        ("iteration,bs\n0,32\n", "line 1: header should be 'step,batchsize', got 'iteration,bs'"),
        (",Time,GPUs\n0,1.0,8\n", "looks like a resource-availability trace"),
        ("step,batchsize\n", "no steps"),
        ("", "no steps"),
        ("step,batchsize\n-1,32\n", "line 2: step should be >= 0 (steps count from 0), got -1"),
        ("step,batchsize\n0,32\n1,32\n-1,32\n", "line 4: step should be >= 0 (steps count from 0), got -1"),
        # Only plain ASCII decimal integers: int() would take all of these.
        (
            "step,batchsize\n0,1_000\n",
            "line 2: batch size should be a plain integer (ASCII digits 0-9 only), got '1_000'",
        ),
        (
            "step,batchsize\n0,+32\n",
            "line 2: batch size should be a plain integer (ASCII digits 0-9 only), got '+32'",
        ),
        (
            "step,batchsize\n0,\u0663\u0662\n",
            "line 2: batch size should be a plain integer (ASCII digits 0-9 only), got '\u0663\u0662'",
        ),
        (
            "step,batchsize\n0,\uff13\uff12\n",
            "line 2: batch size should be a plain integer (ASCII digits 0-9 only)",
        ),
        (
            "step,batchsize\n+0,32\n",
            "line 2: step should be a plain integer (ASCII digits 0-9 only), got '+0'",
        ),
        ("\u0660,32\n", "line 1: step should be a plain integer (ASCII digits 0-9 only), got '\u0660'"),
        (
            "step,batchsize\n0,9223372036854775808\n",
            "line 2: batch size '9223372036854775808' is too large (at most 9223372036854775807)",
        ),
        (
            "step,batchsize\n0," + "9" * 5000 + "\n",
            "line 2: batch size '999999999999999999999999'... (5000 characters) is too large",
        ),
        (
            "step,batchsize\n0,x" + "y" * 5000 + "\n",
            "line 2: batch size should be an integer, got 'xyyyyyyyyyyyyyyyyyyyyyyy'... (5001 characters)",
        ),
        ("step,batchsize\n0," + "9" * 200_000 + "\n", "line 2: not a CSV row: field larger than field limit"),
    ],
)
def test_from_csv_errors_name_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=re.escape(str(path))) as info:
        BatchSizeTrace.from_csv(path)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"step,batchsize\n0,32\n1,\xff\n", "line 3: byte 0xff at column 3 is not UTF-8 text"),
        (b"\xef\xbb\xbfstep,batchsize\n0,32\n1,3\xe92\n", "line 3: byte 0xe9 at column 4 is not UTF-8 text"),
        (
            b"step,batchsize\n" + b"".join(b"%d,8\n" % i for i in range(5000)) + b"\x80",
            "line 5002: byte 0x80",
        ),
    ],
)
def test_from_csv_non_utf8_names_file_and_line(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "latin1.csv"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(f"{path}, {message}")) as info:
        BatchSizeTrace.from_csv(path)
    assert "save the file as UTF-8" in str(info.value)


def test_error_messages_stay_short(tmp_path: Path) -> None:
    for field in ["9" * 5000, "x" * 5000, "-" + "1" * 5000]:
        path = write(tmp_path, f"step,batchsize\n0,{field}\n")
        with pytest.raises(ValueError) as info:
            BatchSizeTrace.from_csv(path)
        assert len(str(info.value)) < len(str(path)) + 150, str(info.value)[:300]
    path = write(tmp_path, "step,batchsize\n0," + "1," * 3000 + "\n")
    with pytest.raises(ValueError, match="expected 2 fields 'step,batchsize', got 3002") as info:
        BatchSizeTrace.from_csv(path)
    assert len(str(info.value)) < len(str(path)) + 150


def test_from_csv_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.csv"):
        BatchSizeTrace.from_csv(tmp_path / "nope.csv")


def test_example_trace(traces_dir: Path) -> None:
    trace = BatchSizeTrace.from_csv(traces_dir / "step_batchsize_example.csv")
    # A 10-step warm-up followed by an 800-step run whose numbering restarts at 0 (line 12).
    assert trace.num_steps == 810
    assert trace.restarts == (10,)
    assert trace.where(10).endswith("step_batchsize_example.csv, line 12 (step 10)")
    assert trace.batch_sizes[:10] == (128, 128, 256, 256, 64, 64, 32, 32, 256, 256)
    assert min(trace) == 32 and max(trace) == 2048
    assert trace.total_samples == 769472
    trace.check_minibatch_size(32)
    with pytest.raises(
        ValueError, match=r"line 2 \(step 0\): batch size 128 is not a multiple of minibatch_size=48"
    ):
        trace.check_minibatch_size(48)


# -- lists, ints, as_trace -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "error", "message"),
    [
        ([32, 0], ValueError, "<list>, step 1: batch size should be positive, got 0"),
        ([32, -8], ValueError, "<list>, step 1: batch size should be positive, got -8"),
        ([32, 1.5], TypeError, "<list>, step 1: batch size should be an int, got float 1.5"),
        ([True], TypeError, "<list>, step 0: batch size should be an int, got bool True"),
        ([], ValueError, "at least one step"),
    ],
)
def test_list_errors(sizes: list, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        BatchSizeTrace(sizes)


def test_as_trace_kinds(tmp_path: Path) -> None:
    path = write(tmp_path, "0,16\n1,32\n")
    assert as_trace(path).batch_sizes == (16, 32)
    assert as_trace(str(path)).batch_sizes == (16, 32)
    assert as_trace([16, 32]) == BatchSizeTrace([16, 32])
    trace = BatchSizeTrace([8])
    assert as_trace(trace) is trace
    constant = as_trace(64)
    assert constant.num_steps is None and constant[10**9] == 64
    for bad in (True, 2.0, None):
        with pytest.raises(TypeError, match="trace should be"):
            as_trace(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        as_trace(0)


def test_unbounded_constant_trace() -> None:
    trace = BatchSizeTrace.constant(100)
    with pytest.raises(ValueError, match="unbounded"):
        len(trace)
    with pytest.raises(ValueError, match="unbounded"):
        trace.to_csv("never.csv")
    # Epochs go on forever: 250 samples -> steps of 100, 100, 50 (drop_last=False) or 100, 100.
    assert trace.epoch(1000, 250).batch_sizes == (100, 100, 50)
    assert trace.epoch(1000, 250).first_step == 3000
    assert trace.epoch(7, 250, drop_last=True) == EpochSteps(7, 14, (100, 100), 250)
    with pytest.raises(ValueError, match="larger than dataset_size=50"):
        trace.epoch(0, 50, drop_last=True)


# -- schedules ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "multiple_of", "sizes"),
    [
        ("constant:64:3", 1, (64, 64, 64)),
        ("linear:32:256:8", 32, (32, 64, 96, 128, 160, 192, 224, 256)),
        ("linear:256:32:3", 32, (256, 160, 32)),  # ramps may go down; 144 rounds to 160
        ("linear:10:20:1", 1, (10,)),
        ("steps:32x2,64x1,16x3", 1, (32, 32, 64, 16, 16, 16)),
        ("linear:32:64:2+constant:128:2", 32, (32, 64, 128, 128)),
    ],
)
def test_from_schedule(spec: str, multiple_of: int, sizes: tuple[int, ...]) -> None:
    trace = BatchSizeTrace.from_schedule(spec, multiple_of=multiple_of)
    assert trace.batch_sizes == sizes
    assert trace.source == spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cosine:1:2:3", "bad schedule part 'cosine:1:2:3'"),
        ("constant:64", "expected constant:BATCH:STEPS"),
        ("constant:0:5", "batch_size must be a positive int, got 0"),
        ("linear:32:x:10", "invalid literal"),
        ("steps:32-2", "phase '32-2' is not BATCHxSTEPS"),
        ("", "non-empty string"),
    ],
)
def test_from_schedule_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        BatchSizeTrace.from_schedule(spec)


def test_linear_ramp_is_monotone_and_hits_ends() -> None:
    trace = BatchSizeTrace.linear(32, 256, 1000, multiple_of=32)
    sizes = trace.batch_sizes
    assert sizes[0] == 32 and sizes[-1] == 256
    assert all(a <= b for a, b in itertools.pairwise(sizes))
    trace.check_minibatch_size(32)


# -- epochs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "dataset_size", "drop_last", "epochs"),
    [
        # drop_last=False: the epoch's last step runs with the samples left, and is consumed.
        ([4, 4, 4, 4, 4, 4], 10, False, [(0, (4, 4, 2)), (3, (4, 4, 2))]),
        # drop_last=True: the step that does not fit starts the next epoch; 2 samples left out.
        ([4, 4, 4, 4, 4, 4, 4], 10, True, [(0, (4, 4)), (2, (4, 4)), (4, (4, 4))]),
        ([2, 8, 6, 4, 10], 10, False, [(0, (2, 8)), (2, (6, 4)), (4, (10,))]),
        ([2, 8, 6, 4, 10], 10, True, [(0, (2, 8)), (2, (6, 4)), (4, (10,))]),
        ([6, 6, 3, 1], 8, True, [(0, (6,)), (1, (6,))]),  # neither 6 nor 3 fits in the 2 samples left
    ],
)
def test_epoch_split(
    sizes: list[int], dataset_size: int, drop_last: bool, epochs: list[tuple[int, tuple[int, ...]]]
) -> None:
    trace = BatchSizeTrace(sizes)
    got = trace.split_epochs(dataset_size, len(epochs), drop_last=drop_last)
    assert [(e.first_step, e.batch_sizes) for e in got] == epochs
    assert [e.epoch for e in got] == list(range(len(epochs)))
    for e in got:
        assert e.num_samples + e.leftover == dataset_size
        assert e.leftover == 0 or drop_last


def test_epoch_too_short_names_trace_and_epoch(tmp_path: Path) -> None:
    path = write(tmp_path, "0,4\n1,4\n2,4\n3,4\n4,4\n")
    trace = BatchSizeTrace.from_csv(path)
    assert trace.num_full_epochs(8) == 2
    assert len(trace.split_epochs(8)) == 2
    message = f"trace '{path}' is too short: it has 5 steps (20 samples in all) and ends 4 samples before the end of epoch 2"
    with pytest.raises(ValueError, match=re.escape(message)):
        trace.split_epochs(8, 3)
    with pytest.raises(ValueError, match="it covers 2 full epochs and 1 steps of epoch 2"):
        trace.epoch(5, 8)
    assert trace.epoch(2, 8) == EpochSteps(2, 4, (4,), 8, truncated=True)  # the steps it has run
    assert trace.num_epochs(8) == 3


def test_a_trace_shorter_than_one_epoch_runs_its_steps() -> None:
    # It raised, advising "fewer epochs" than 0.
    trace = BatchSizeTrace([32, 16])
    assert (trace.num_full_epochs(64), trace.num_epochs(64)) == (0, 1)
    assert trace.epoch(0, 64) == EpochSteps(0, 0, (32, 16), 64, truncated=True)
    with pytest.raises(ValueError, match=r"too short.*it covers 0 full epochs and 2 steps of epoch 0"):
        trace.epoch(1, 64)


def test_example_trace_epochs(traces_dir: Path) -> None:
    trace = BatchSizeTrace.from_csv(traces_dir / "step_batchsize_example.csv")
    for drop_last in (False, True):
        epochs = trace.split_epochs(60000, drop_last=drop_last)
        assert len(epochs) == 12
        assert epochs[0].first_step == 0
        for a, b in itertools.pairwise(epochs):
            assert b.first_step == a.end_step  # the step counter is global
        for e in epochs:
            assert e.batch_sizes[:-1] == trace[e.first_step : e.end_step - 1]
            if drop_last:
                assert e.batch_sizes == trace[e.first_step : e.end_step]
                assert 0 <= e.leftover < trace[e.end_step]
            else:
                assert e.num_samples == 60000 and 0 < e.batch_sizes[-1] <= trace[e.end_step - 1]
    with pytest.raises(ValueError, match="too short"):
        trace.split_epochs(60000, 13)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=60),
    dataset_size=st.integers(1, 100),
    drop_last=st.booleans(),
)
def test_epochs_partition_the_trace(sizes: list[int], dataset_size: int, drop_last: bool) -> None:
    trace = BatchSizeTrace(sizes)
    try:
        epochs = trace.split_epochs(dataset_size, drop_last=drop_last)
    except ValueError as e:
        assert drop_last and "larger than dataset_size" in str(e)
        assert any(s > dataset_size for s in sizes)
        return
    step = 0
    for e in epochs:
        first, end = e.first_step, e.end_step
        assert first == step and e.num_steps >= 1
        if drop_last:
            assert e.batch_sizes == tuple(sizes[first:end]) and e.leftover >= 0
            if end < len(sizes):
                assert sizes[end] > e.leftover  # the next step did not fit
        else:
            assert e.num_samples == dataset_size and e.leftover == 0
            assert e.batch_sizes[:-1] == tuple(sizes[first : end - 1]) and e.batch_sizes[-1] <= sizes[end - 1]
        step = end
    # What is left of the trace does not complete another epoch.
    left = dataset_size
    for size in sizes[step:]:
        if left == 0 or (drop_last and size > left):
            break
        left = max(0, left - size)
    assert left > 0, "the rest of the trace completes an epoch that split_epochs left out"
    rest = tuple(sizes[step:])
    if rest:  # the trace ends inside the next epoch: it runs the steps it has
        last = trace.epoch(len(epochs), dataset_size, drop_last=drop_last)
        assert (last.first_step, last.batch_sizes, last.truncated) == (step, rest, True)
        assert last.leftover == dataset_size - sum(rest) > 0
    with pytest.raises(ValueError, match="too short"):
        trace.epoch(len(epochs) + (1 if rest else 0), dataset_size, drop_last=drop_last)


def test_drop_last_batch_larger_than_dataset() -> None:
    trace = BatchSizeTrace([4, 16, 4])
    with pytest.raises(ValueError, match=r"<list>, step 1: batch size 16 is larger than dataset_size=8"):
        trace.split_epochs(8, 2, drop_last=True)
    assert trace.epoch(0, 8).batch_sizes == (4, 4)  # drop_last=False cuts step 1 to the 4 samples left


# -- availability traces --------------------------------------------------------------------------


def test_from_availability_holds_steps_per_interval(tmp_path: Path) -> None:
    path = write(tmp_path, ",Time,GPUs\n0,100.0,2\n1,110.0,0\n2,120.0,4\n3,125.5,1\n4,126.0,3\n")
    trace = BatchSizeTrace.from_availability(path, per_device_batch=16, step_time=4)
    # Steps start at 100, 104, 108 (2 GPUs), 112, 116 (no GPU: none), 120, 124 (4 GPUs); 125.5..126
    # holds no step start; the last row only marks the end.
    assert trace.batch_sizes == (32, 32, 32, 64, 64)
    assert trace.where(3).endswith("line 4 (step 3)")
    assert BatchSizeTrace.from_availability(path, 16, 4, max_steps=2).batch_sizes == (32, 32)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("step,batchsize\n0,1\n1,2\n", "header should name a 'Time' column"),
        (",Time,GPUs\n0,1.0,2\n1,x,2\n", "line 3: time should be a number, got 'x'"),
        (",Time,GPUs\n0,1.0,2\n1,2.0,-1\n", "line 3: device count should be an integer >= 0, got '-1'"),
        (",Time,GPUs\n0,1.0,2\n1,2.0,1.5\n", "line 3: device count should be an integer >= 0, got '1.5'"),
        (",Time,GPUs\n0,5.0,2\n1,5.0,2\n", "line 3: time 5.0 does not increase"),
        (",Time,GPUs\n0,1.0,2\n1,2.0\n", "line 3: expected 3 fields like the header, got 2"),
        (",Time,GPUs\n0,1.0,2\n", "needs at least 2 rows"),
        (",Time,GPUs\n0,1.0,0\n1,100.0,0\n", "no step fits"),
        (
            ",Time,GPUs\n0,1.0,2\n1,2.0,\u0662\n",
            "line 3: device count should be an integer >= 0, got '\u0662'",
        ),
        (",Time,GPUs\n0,1.0,2\n1,2.0,+2\n", "line 3: device count should be an integer >= 0, got '+2'"),
        (",Time,GPUs\n0,1_0,2\n1,20,2\n", "line 2: time should be a number, got '1_0'"),
        (
            ",Time,GPUs\n0,1.0,2\n1,2.0," + "9" * 5000 + "\n",
            "line 3: device count '999999999999999999999999'... (5000 characters) is too large",
        ),
        (
            ",Time,GPUs\n0,0,2\n1,1e12,2\n",
            "hold 1e+12 steps, more than the 10000000 a trace may have; pass max_steps",
        ),
    ],
)
def test_from_availability_errors(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=re.escape(str(path))) as info:
        BatchSizeTrace.from_availability(path, per_device_batch=8, step_time=1.0)
    assert message in str(info.value)


def test_from_availability_work_is_bounded_by_max_steps(tmp_path: Path) -> None:
    # A time gap of 1e12 s at 1 s per step: 1e12 steps, of which only max_steps are built.
    gap = write(tmp_path, ",Time,GPUs\n0,0,2\n1,1e12,3\n2,2e12,0\n")
    assert BatchSizeTrace.from_availability(gap, 8, 1.0, max_steps=10).batch_sizes == (16,) * 10
    assert BatchSizeTrace.from_availability(gap, 8, 1e6, max_steps=10**7).num_steps == 2 * 10**6
    with pytest.raises(
        ValueError, match=r"hold 2e\+12 steps, more than the 10000000 a trace may have"
    ) as info:
        BatchSizeTrace.from_availability(gap, 8, 1.0, max_steps=10**12)
    assert str(gap) in str(info.value)
    # A step time of 1e-300 s: more steps than a float can count over 1e12 s; over 100 s, 1e302.
    with pytest.raises(ValueError, match=r"its 2e\+12 s at step_time=1e-300 s are too many steps to count"):
        BatchSizeTrace.from_availability(gap, 8, 1e-300, max_steps=10)
    short = write(tmp_path, ",Time,GPUs\n0,0,2\n1,100,0\n", name="short.csv")
    assert BatchSizeTrace.from_availability(short, 8, 1e-300, max_steps=3).batch_sizes == (16, 16, 16)
    with pytest.raises(ValueError, match=r"hold 1e\+302 steps"):
        BatchSizeTrace.from_availability(short, 8, 1e-300)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("constant:8:1000000000", "constant:8:1000000000 has 1000000000 steps, more than the 10000000"),
        ("linear:8:16:1000000000", "linear:8:16:1000000000 has 1000000000 steps"),
        ("steps:8x5,16x1000000000", "has 1000000005 steps"),
    ],
)
def test_absurd_schedules_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        BatchSizeTrace.from_schedule(spec)


@pytest.mark.parametrize(
    ("name", "interval", "counts"),
    [("gcp_a100_gpus.csv", 63, range(0, 57)), ("gcp_tpuv2-8_cores.csv", 30, range(24, 121, 8))],
)
def test_from_availability_real_traces(traces_dir: Path, name: str, interval: int, counts: range) -> None:
    path = traces_dir / name
    rows = [line.split(",") for line in path.read_text().splitlines()[1:]]
    devices = [int(r[2]) for r in rows[:-1]]  # the last row only marks the end
    # A step time that divides the sampling interval: every interval holds exactly interval/step_time steps.
    step_time = interval / 7
    trace = BatchSizeTrace.from_availability(path, per_device_batch=4, step_time=step_time)
    expected = [d * 4 for d in devices for _ in range(7) if d > 0]
    assert list(trace) == expected
    assert set(trace) <= {c * 4 for c in counts}
    # One step per ~30 s of a 10 s step time: the number of steps follows the covered time.
    coarse = BatchSizeTrace.from_availability(path, per_device_batch=1, step_time=10.0)
    busy = sum(interval for d in devices if d > 0)
    assert abs(len(coarse) - busy / 10) <= len(devices)


# -- output ---------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 10**6), min_size=1, max_size=50))
def test_csv_round_trip(tmp_path_factory: pytest.TempPathFactory, sizes: list[int]) -> None:
    path = tmp_path_factory.mktemp("roundtrip") / "t.csv"
    BatchSizeTrace(sizes).to_csv(path)
    assert BatchSizeTrace.from_csv(path) == BatchSizeTrace(sizes)
    assert path.read_text().splitlines()[:2] == ["step,batchsize", f"0,{sizes[0]}"]


def test_example_trace_round_trip(traces_dir: Path, tmp_path: Path) -> None:
    trace = BatchSizeTrace.from_csv(traces_dir / "step_batchsize_example.csv")
    trace.to_csv(tmp_path / "copy.csv")
    copy = BatchSizeTrace.from_csv(tmp_path / "copy.csv")
    assert copy == trace and copy.restarts == ()  # written with one step numbering
    assert copy.fingerprint() == trace.fingerprint()


@pytest.mark.parametrize(
    ("rule", "expected"),
    [("constant", 0.1), ("linear", 0.4), ("sqrt", 0.2)],
)
def test_scaled_lr(rule: str, expected: float) -> None:
    assert math.isclose(scaled_lr(0.1, 1024, 256, rule), expected)


def test_scaled_lr_rejects_unknown_rule() -> None:
    with pytest.raises(ValueError, match="rule should be one of"):
        scaled_lr(0.1, 64, 32, "cubic")


@pytest.mark.parametrize("lr", [None, 0.1])
def test_plot_writes_png(tmp_path: Path, lr: float | None) -> None:
    path = tmp_path / "trace.png"
    BatchSizeTrace.from_schedule("linear:32:256:50+constant:256:50", multiple_of=32).plot(
        path, lr=lr, ref_batch_size=256, rule="sqrt"
    )
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    height = matplotlib.image.imread(path).shape[0]
    assert height > 400 if lr is not None else height < 400  # the lr panel doubles the height


def test_plot_unbounded_needs_num_steps(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_steps"):
        BatchSizeTrace.constant(8).plot(tmp_path / "x.png")
    BatchSizeTrace.constant(8).plot(tmp_path / "x.png", num_steps=10)
    assert (tmp_path / "x.png").stat().st_size > 0


def test_trace_modules_split_by_concept() -> None:
    # trace.py held CSV parsing, availability traces, the LR rule and plotting together.
    import torchfold.train.optim.lr as lr
    import torchfold.train.schedule.availability as availability
    import torchfold.train.schedule.plot as plot
    import torchfold.train.schedule.trace as trace

    assert {"read_availability", "AvailabilityInterval", "availability_batch_sizes"} <= set(
        availability.__all__
    )
    assert set(lr.__all__) == {"LR_RULES", "scaled_lr"} and set(plot.__all__) == {"plot_trace"}
    assert not {"scaled_lr", "read_availability", "AvailabilityInterval"} & set(trace.__all__)


def test_plotting_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    # matplotlib is imported when a plot is drawn: importing the train half never needs it.
    script = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as if not installed\n"
        "import torchfold.train as tt\n"
        "assert 'matplotlib.figure' not in sys.modules\n"
        "try:\n"
        f"    tt.BatchSizeTrace([4, 8]).plot({str(tmp_path / 'x.png')!r})\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "plotting a trace needs matplotlib" in done.stdout
        and "pip install 'pytorch-fold[plot]'" in done.stdout
    )


@given(st.lists(st.integers(1, 600), min_size=1, max_size=8), st.integers(1, 64))
def test_largest_minibatch_size_divides_every_batch_and_no_larger_one_does(
    sizes: list[int], at_most: int
) -> None:
    size = BatchSizeTrace(sizes).largest_minibatch_size(at_most)
    assert 1 <= size <= at_most and all(batch % size == 0 for batch in sizes)
    assert not any(all(batch % larger == 0 for batch in sizes) for larger in range(size + 1, at_most + 1))


def test_largest_minibatch_size_refuses_a_bound_below_one() -> None:
    with pytest.raises(ValueError, match="at_most"):
        BatchSizeTrace([8]).largest_minibatch_size(0)


# -- one syntax: as_trace and the command line's --trace ----------------------------------------


@pytest.mark.parametrize(
    ("text", "sizes", "num_steps"),
    [
        ("32", (32,), None),
        (" 32 ", (32,), None),
        ("32,64,96", (32, 64, 96), 3),
        ("32, 64, 96", (32, 64, 96), 3),
        ("8", (8,), None),
        ("linear:32:128:4", (32, 64, 96, 128), 4),
        ("steps:25x2,50x1", (25, 25, 50), 3),
        ("constant:16:2+steps:8x1", (16, 16, 8), 3),
        ("trace.csv", (16, 32), 2),
    ],
)
def test_as_trace_and_the_command_line_take_the_same_strings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, sizes: tuple[int, ...], num_steps: int | None
) -> None:
    """``StepLoader(trace=...)`` (:func:`as_trace`) once read every string as a CSV path (a bare
    FileNotFoundError for ``"linear:32:256:60"``), and ``--trace 32,64,96`` said ``No such file or
    directory``: both now take every form, by one rule."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "step,batchsize\n0,16\n1,32\n", name="trace.csv")
    for trace in (as_trace(text), BatchSizeTrace.parse(text)):
        assert trace.batch_sizes == sizes and trace.num_steps == num_steps


FORMS = "a step,batchsize CSV file, an integer (a constant batch size: 256), a list of batch sizes (32,64,96)"


@pytest.mark.parametrize(
    ("text", "error", "needles"),
    [
        (
            "nope.csv",
            FileNotFoundError,
            ["trace 'nope.csv': no such file, and no other form of trace", FORMS],
        ),
        ("linear:32", ValueError, ["trace 'linear:32': bad schedule part", "linear:START:END:STEPS"]),
        ("32,x", FileNotFoundError, ["trace '32,x': no such file"]),  # no list, no schedule: a file name
        ("32,64.5", ValueError, ["trace '32,64.5': a list of batch sizes holds whole numbers", "'64.5'"]),
        ("32,0", ValueError, ["trace '32,0': batch sizes must be positive integers, got 0 at position 1"]),
        ("0", ValueError, ["trace '0': a constant global batch size must be a positive integer"]),
        ("2.5", ValueError, ["trace '2.5'", "whole number of samples, e.g. trace=2"]),
        ("", ValueError, ["trace '': empty", FORMS]),
    ],
)
def test_a_trace_string_of_no_form_names_the_value_and_the_forms(
    text: str, error: type[Exception], needles: list[str]
) -> None:
    with pytest.raises(error) as info:
        as_trace(text)
    for needle in needles:
        assert needle in str(info.value)
    # the command line: the same rule, the same words, after its flag; a usage error (ValueError)
    with pytest.raises(ValueError) as cli:
        BatchSizeTrace.parse(text)
    assert str(cli.value).startswith(f"--trace {text}")
    assert str(info.value).partition(": ")[2].replace("trace=", "--trace ") in str(cli.value)


def test_a_directory_is_no_trace(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(f"trace {str(tmp_path)!r} is a directory; give {FORMS}")):
        as_trace(str(tmp_path))
