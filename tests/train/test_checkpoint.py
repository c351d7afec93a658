"""Checkpoints: atomic writes, weights-only loads, generator states, and clear errors for bad files."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _loop_worker import make_trainer, sst_trees
from _train_cli import run_train, small_run, train

from torchfold.train.loop.checkpoint import (
    CheckpointDirLock,
    HyperparameterMismatch,
    checkpoint_path,
    keep_hyperparameters,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)


class _Opaque:
    """Not a tensor or plain container: weights-only loading must refuse it."""


def test_save_is_atomic_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = checkpoint_path(tmp_path / "new" / "dir", 7)
    save_checkpoint({"step": 7, "w": torch.arange(3)}, path)
    assert path.name == "step-00000007.pt"
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save_checkpoint({"step": 8, "bad": lambda: None}, path)  # fails half-way through writing
    state = load_checkpoint(path)  # the previous content is intact
    assert state["step"] == 7 and torch.equal(state["w"], torch.arange(3))
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-00000007.pt"]


def test_ctrl_c_while_saving_is_a_keyboard_interrupt_and_leaves_the_earlier_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real SIGINT lands while torch.save writes: its C++ writer turns the KeyboardInterrupt raised
    # in the write into a RuntimeError ("unexpected pos"); save_checkpoint raises the interrupt.
    path = checkpoint_path(tmp_path, 1)
    save_checkpoint({"step": 1}, path)
    real_save = torch.save

    class Interrupted(io.RawIOBase):
        def __init__(self, handle: Any) -> None:
            self.handle, self.writes = handle, 0

        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            self.writes += 1
            if self.writes == 2:
                os.kill(os.getpid(), signal.SIGINT)  # Python's handler raises KeyboardInterrupt here
            return int(self.handle.write(data))

    monkeypatch.setattr(torch, "save", lambda state, handle: real_save(state, Interrupted(handle)))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            save_checkpoint({"step": 2, "w": torch.randn(1000)}, path)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert caught.value.__suppress_context__  # not "During handling of ... RuntimeError"
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file


def test_list_latest_and_prune(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None and list_checkpoints(tmp_path / "missing") == []
    for step in (12, 3, 100):
        save_checkpoint({"step": step}, checkpoint_path(tmp_path, step))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 12, 100]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000100.pt"
    assert prune_checkpoints(tmp_path, keep=2) == [tmp_path / "step-00000003.pt"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [12, 100]
    with pytest.raises(ValueError, match="keep must be a positive int, got 0; how many checkpoints to keep"):
        prune_checkpoints(tmp_path, keep=0)
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1; the optimizer step"):
        checkpoint_path(tmp_path, -1)


def _truncated(path: Path) -> None:
    save_checkpoint({"step": 5, "w": torch.randn(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00\x01not a checkpoint at all" * 10)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _foreign(path: Path) -> None:
    torch.save({"state_dict": {"w": torch.ones(1)}}, path)


def _tensor(path: Path) -> None:
    torch.save(torch.ones(2), path)


def _newer(path: Path) -> None:
    save_checkpoint({"version": 99}, path)


def _opaque(path: Path) -> None:
    torch.save({"format": "torchfold.checkpoint", "version": 1, "x": _Opaque()}, path)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_truncated, r"cannot be read: it is truncated or damaged \(its zip archive: "),
        (_garbage, r"cannot be read: it is not a torchfold checkpoint, or it is damaged \(not a zip archive"),
        (_empty, "cannot be read: it is empty; "),
        (
            _opaque,
            r"holds objects other than tensors and plain containers \(it holds a .*_Opaque\), so it is not a",
        ),
        (_foreign, r"is not a torchfold checkpoint \(it holds a dict with keys \['state_dict'\]"),
        (_tensor, r"is not a torchfold checkpoint \(it holds Tensor"),
        (_newer, "has format version 99, but this torchfold reads versions up to 1; upgrade torchfold"),
    ],
)
def test_bad_files_get_an_error_naming_the_file_and_the_fix(tmp_path: Path, damage: Any, match: str) -> None:
    save_checkpoint({"step": 3}, checkpoint_path(tmp_path, 3))
    path = checkpoint_path(tmp_path, 6)
    damage(path)
    with pytest.raises(ValueError, match=match) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)
    assert f"delete it to resume from the previous checkpoint {tmp_path / 'step-00000003.pt'}" in str(
        info.value
    )


def test_an_intact_file_is_never_called_corrupt(tmp_path: Path) -> None:
    # Read straight onto an XLA device, a checkpoint failed in torch.load, and the message said
    # to delete the (intact) file as truncated or corrupt.
    path = save_checkpoint({"step": 3, "w": torch.ones(2)}, checkpoint_path(tmp_path, 3))
    with pytest.raises(ValueError) as info:
        load_checkpoint(path, map_location="xla:0")  # without torch_xla: the same failure as with it
    message = str(info.value)
    assert message.startswith(
        f"checkpoint {path} is intact, but its tensors cannot be loaded with map_location"
    )
    assert "corrupt" not in message and "delete" not in message
    assert "load it on the CPU (the default)" in message
    assert torch.equal(load_checkpoint(path)["w"], torch.ones(2))


def test_the_device_options_of_a_checkpoint_follow_this_run(saved: Path) -> None:
    # Optimizer.load_state_dict took `capturable` and `fused` from the file: an XLA checkpoint
    # (capturable) resumed on the CPU failed, a CPU one (fused) on XLA too.
    state = load_checkpoint(saved)
    for group in state["optimizer"]["param_groups"]:
        group.update(capturable=True, fused=True, foreach=True)  # as written on another device
    trainer = make_trainer(sst_trees())
    here = [
        {key: group[key] for key in ("capturable", "fused", "foreach")}
        for group in trainer.optimizer.param_groups
    ]
    trainer.load_state_dict(state, source="checkpoint edited")
    assert [
        {key: group[key] for key in ("capturable", "fused", "foreach")}
        for group in trainer.optimizer.param_groups
    ] == here
    assert trainer.optimizer.param_groups[0]["capturable"] is False
    assert [s.step for s in trainer.fit(max_steps=3)] == [2]  # and the update runs


def test_a_lone_bad_file_says_to_start_afresh(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    _garbage(path)
    with pytest.raises(
        ValueError, match="delete it \\(or point to another checkpoint\\) and start without resuming"
    ):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*nothing\.pt does not exist"):
        load_checkpoint(tmp_path / "nothing.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the test loop after 2 steps."""
    directory = tmp_path_factory.mktemp("ckpt")
    trainer = make_trainer(sst_trees(), checkpoint_dir=str(directory))
    trainer.fit(max_steps=2)
    return directory / "step-00000002.pt"


def _edit(saved: Path, tmp_path: Path, change: Any) -> Path:
    state = load_checkpoint(saved)
    change(state)
    return save_checkpoint(state, tmp_path / "edited.pt")  # (a step-N.pt name must say its step)


def _as_written_by_0_1_0(state: dict[str, Any], change: Any) -> None:
    """``change`` the torch optimizer's state, then nest it as torchfold 0.1.0 did."""
    optimizer = state["optimizer"]
    mine = optimizer.pop("torchfold")
    change(optimizer)
    state["optimizer"] = {"optimizer": optimizer, "torchfold": mine}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (  # another world size is fine, but then there are as many generator states
            lambda s: s.update(world_size=2),
            r"its rng should be a list of 2 generator states \(one per process\), got a list of 1;",
        ),
        (
            lambda s: s.pop("loader"),
            r"lacks \['loader'\]: it was not written by TraceTrainer.save_checkpoint",
        ),
        (
            lambda s: s["model"].update(classifier_weight=s["model"].pop("classifier.weight")),
            r"its model state does not fit this run: .*Missing key\(s\).*Resume with the settings",
        ),
        (
            lambda s: s["model"].update({"embedding.weight": s["model"]["embedding.weight"][:, :4]}),
            r"its model state does not fit this run: .*size mismatch for embedding.weight",
        ),
        (
            lambda s: s["optimizer"]["torchfold"].update(lr_rule="sqrt"),
            "its optimizer state does not fit this run: state_dict was saved with lr_rule='sqrt'",
        ),
        (
            lambda s: s["loader"]["sampler"].update(minibatch_size=4),
            "its loader state does not fit this run: sampler state was saved with minibatch_size=4",
        ),
        (
            lambda s: s["loader"]["sampler"].update(minibatch_size=None, max_device_batch_size=8),
            "its loader state does not fit this run: sampler state was saved with minibatch_size=None but this "
            "sampler has minibatch_size=6",
        ),
        # Files that load but hold values no run writes: refused before anything is restored.
        (
            lambda s: s.update(rng="garbage"),
            r"its rng should be a list of 1 generator states \(one per process\), got 'garbage'; the file was "
            "damaged or edited",
        ),
        (
            lambda s: s["rng"][0].update(torch=torch.zeros(10, dtype=torch.uint8)),
            r"generator states of rank 0 are unusable: 'torch' should be a torch.uint8 tensor of shape "
            r"\(5056,\), got a torch.uint8 tensor of shape \(10,\)",
        ),
        (
            lambda s: s["rng"][0].update(torch=torch.full((5056,), 255, dtype=torch.uint8)),
            "generator states of rank 0 are unusable: 'torch' is not a state of torch's generator",
        ),
        (
            lambda s: s["rng"][0].update(python=[3, [1, 2], None]),
            "'python' is not a state of Python's random module",
        ),
        (
            lambda s: s["rng"][0].update(numpy=["MT19937", torch.zeros(3, dtype=torch.int64), 0, 0, 0.0]),
            "'numpy' is not a state of NumPy's global generator",
        ),
        (
            lambda s: s.update(step="ninety"),
            r"its step should be an int >= 0 \(steps completed\), got 'ninety'",
        ),
        (lambda s: s.update(step=True), r"its step should be an int >= 0 \(steps completed\), got True"),
        (lambda s: s.update(world_size="1"), "its world_size should be an int >= 1, got '1'"),
        (
            lambda s: s["optimizer"].update(state="x"),
            "its optimizer state does not fit this run: 'str' object has no attribute",
        ),
        # Hand edits that loaded and then failed mid-training, or trained nothing, or advised
        # "--lr nan": refused before anything is restored, naming the entry.
        (
            lambda s: s["optimizer"]["state"][1].pop("exp_avg"),
            r"its optimizer state of parameter 1 lacks \['exp_avg'\] \(Adam needs \['step', 'exp_avg', "
            "'exp_avg_sq'\\]",
        ),
        (
            lambda s: s.update(step=10**12),
            r"its step 1000000000000 is not where its loader stands \(next_step 2\): the file was damaged or edited",
        ),
        (
            lambda s: s["optimizer"]["param_groups"][0].update(lr=float("nan")),
            r"the lr of its optimizer's param group 0 should be a finite number >= 0, got nan; the file was damaged",
        ),
        # the same two in the form torchfold 0.1.0 wrote (the torch optimizer's state nested)
        (
            lambda s: _as_written_by_0_1_0(s, lambda o: o["state"][1].pop("exp_avg")),
            r"its optimizer state of parameter 1 lacks \['exp_avg'\]",
        ),
        (
            lambda s: _as_written_by_0_1_0(s, lambda o: o["param_groups"][0].update(lr=float("nan"))),
            r"the lr of its optimizer's param group 0 should be a finite number >= 0, got nan",
        ),
    ],
)
def test_a_checkpoint_of_another_run_is_refused_naming_the_file(
    saved: Path, tmp_path: Path, change: Any, match: str
) -> None:
    path = _edit(saved, tmp_path, change)
    trainer = make_trainer(sst_trees())
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match=match) as info:
        trainer.load_checkpoint(path)
    assert f"checkpoint {path}" in str(info.value)
    if any(
        word in match for word in ("rng", "step", "lr of", "lacks")
    ):  # checked before anything is restored
        assert all(torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())


def test_the_cli_reports_a_corrupt_checkpoint_and_a_bad_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = small_run(tmp_path, "--checkpoint-dir", str(tmp_path / "ck"))
    history = tmp_path / "history.jsonl"
    assert train([*args, "--max-steps", "2", "--history", str(history)]) == 0
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    assert [(r["step"], r["batch_size"], r["num_minibatches"]) for r in lines] == [(0, 12, 2), (1, 12, 2)]
    _truncated(checkpoint_path(tmp_path / "ck", 4))
    assert train([*args, "--max-steps", "6"]) == 2
    err = capsys.readouterr().err
    assert f"torchfold train: error: checkpoint {tmp_path / 'ck' / 'step-00000004.pt'} cannot be read" in err
    assert f"delete it to resume from the previous checkpoint {tmp_path / 'ck' / 'step-00000002.pt'}" in err
    assert train([*args, "--max-steps", "6", "--no-resume"]) == 0  # starts afresh
    assert train(["--trace", "7", "--data", str(tmp_path / "data"), "--minibatch-size", "6"]) == 2
    assert (
        "--trace 7: constant:7, step 0: batch size 7 is not a multiple of --minibatch-size 6"
        in capsys.readouterr().err
    )


def _cli(tmp_path: Path, *extra: str) -> list[str]:
    sgd = ("--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9")
    return small_run(tmp_path, "--checkpoint-dir", str(tmp_path / "ck"), *sgd, *extra)


def test_the_cli_resume_refuses_another_lr_momentum_or_optimizer_unless_overridden(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_train(_cli(tmp_path, "--max-steps", "2"), capsys)[0] == 0
    ck = tmp_path / "ck" / "step-00000002.pt"
    refused = [
        (
            ("--lr", "0.02"),
            "was written with --lr 0.01, this run has --lr 0.02; resume with --lr 0.01, or add "
            "--override-lr to train on with --lr 0.02",
        ),
        (
            ("--momentum", "0.5"),
            "was written with --momentum 0.9, this run has --momentum 0.5; resume with "
            "--momentum 0.9, or add --override-momentum to train on with --momentum 0.5",
        ),
        (
            ("--optimizer", "adam"),
            "was written with --optimizer sgd, this run has --optimizer adam; resume with "
            "--optimizer sgd, or start afresh (--no-resume or another --checkpoint-dir)",
        ),
    ]
    for change, message in refused:
        code, out, err = run_train([*_cli(tmp_path, "--max-steps", "3"), *change], capsys)
        assert code == 2 and err == f"torchfold train: error: checkpoint {ck} {message}\n", err
        assert "resumed" not in out
    code, out, err = run_train(
        [
            *_cli(tmp_path, "--max-steps", "3"),
            "--lr",
            "0.02",
            "--override-lr",
            "--momentum",
            "0.5",
            "--override-momentum",
        ],
        capsys,
    )
    assert (code, err) == (0, ""), err
    assert "--override-lr: training on with --lr 0.02 instead of the checkpoint's 0.01" in out
    assert "--override-momentum: training on with --momentum 0.5 instead of the checkpoint's 0.9" in out
    [group] = load_checkpoint(tmp_path / "ck" / "step-00000003.pt")["optimizer"]["param_groups"]
    assert (group["lr"], group["momentum"]) == (0.02, 0.5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--lr", "inf"), "argument --lr: must be a finite positive number, got inf"),
        (("--lr", "1e300"), "--lr 1e+300 is beyond float32's range (at most 3.4e+38)"),
        (("--momentum", "nan"), "argument --momentum: must be a finite number >= 0, got nan"),
        (
            ("--seed", "99999999999999999999"),
            "argument --seed: must be an integer from 0 to 9223372036854775807 (2**63 - 1), got 99999999999999999999",
        ),
        (
            ("--max-words", "1"),
            "--max-words 1: no training tree in {data} has at most 1 words (the shortest has {shortest}); use "
            "--max-words {shortest} or more",
        ),
    ],
)
def test_the_cli_names_the_bad_option_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: tuple[str, ...], message: str
) -> None:
    code, out, err = run_train([*_cli(tmp_path, "--max-steps", "1"), *change], capsys)
    assert code == 2 and "resumed" not in out
    shortest = min(len(tree.words()) for tree in sst_trees()[:24])
    assert err.splitlines()[-1].endswith(message.format(data=tmp_path / "data", shortest=shortest)), err


def test_the_cli_stops_with_exit_1_when_the_loss_becomes_non_finite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An SGD learning rate near float32's limit: the loss overflows within a few steps.
    args = _cli(tmp_path, "--max-steps", "10", "--checkpoint-every", "2", "--lr", "3e38")
    code, out, err = run_train(args, capsys)
    assert code == 1 and "done:" not in out
    found = re.fullmatch(
        r"torchfold train: error: step (\d+): the loss became (inf|nan), so training stopped before saving this "
        rf"step; the last checkpoint written is {re.escape(str(tmp_path / 'ck'))}/step-(\d+)\.pt: resume from it "
        r"\(or an earlier one\) with a lower learning rate\n",
        err,
    )
    assert found is not None, err
    step, saved = int(found.group(1)), int(found.group(3))
    assert 0 < saved <= step < 10
    assert [s for s, _ in list_checkpoints(tmp_path / "ck")][-1] == saved  # nothing saved after it


# keep_hyperparameters: resuming refuses a checkpoint's other optimizer or hyperparameters, or keeps the run's.


def _saved(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    return {"optimizer": optimizer.state_dict()}


def test_a_different_learning_rate_or_optimizer_is_refused_before_loading() -> None:
    model = torch.nn.Linear(2, 1)
    saved = _saved(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    run = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    with (
        pytest.raises(HyperparameterMismatch) as caught,
        keep_hyperparameters(saved, run, "checkpoint a.pt", override=["lr"]),
    ):
        pytest.fail("the block ran")
    assert (caught.value.name, caught.value.saved, caught.value.value) == ("momentum", 0.9, 0.5)
    assert str(caught.value) == (
        "checkpoint a.pt was written with momentum 0.9, this run has momentum 0.5; resume with momentum=0.9, or "
        "keep momentum=0.5 with keep_hyperparameters(override=['momentum'])"
    )
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)
    with (
        pytest.raises(
            HyperparameterMismatch, match="written with optimizer 'sgd', this run has optimizer 'adam'"
        ),
        keep_hyperparameters(saved, torch.optim.Adam(model.parameters(), lr=0.1), "checkpoint a.pt"),
    ):
        pass


def test_an_overridden_value_stays_after_loading_and_an_equal_one_is_not_reported() -> None:
    model = torch.nn.Linear(2, 1)
    saved = _saved(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    run = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    with keep_hyperparameters(saved, run, "checkpoint a.pt", override=["lr", "momentum"]) as kept:
        run.load_state_dict(saved["optimizer"])  # type: ignore[arg-type]
        assert run.param_groups[0]["lr"] == 0.1  # what loading alone does
    assert kept == {"lr": (0.1, 0.02)}
    assert (run.param_groups[0]["lr"], run.param_groups[0]["momentum"]) == (0.02, 0.9)
    with (
        pytest.raises(ValueError, match=r"override='lr'\): give a list of \['lr', 'momentum'\]"),
        keep_hyperparameters(saved, run, "checkpoint a.pt", override="lr"),
    ):
        pass


# -- damaged files and misleading names --------------------------------------------------------


def _flipped(path: Path, position: int, mask: int) -> Path:
    """A copy of ``path`` (under the same name, in a subdirectory) with byte ``position`` XORed with ``mask``."""
    data = bytearray(path.read_bytes())
    data[position] ^= mask
    copy = path.parent / "flipped" / path.name
    copy.parent.mkdir(exist_ok=True)
    copy.write_bytes(bytes(data))
    return copy


def test_a_flipped_bit_anywhere_is_refused_or_harmless(tmp_path: Path) -> None:
    # One bit flipped in the newest checkpoint: 9 of 10 runs resumed silently from other values
    # (torch.load reads no CRC, and the zip's CRCs were checked only after it failed).
    path = save_checkpoint({"step": 3, "w": torch.randn(64)}, checkpoint_path(tmp_path, 3))
    original = load_checkpoint(path)
    size = path.stat().st_size
    for position in range(size):  # every byte, one bit each
        copy = _flipped(path, position, 1 << (position % 8))
        try:
            state = load_checkpoint(copy)
        except ValueError as e:
            assert str(e).startswith(f"checkpoint {copy} cannot be read: it is"), (position, str(e))
            assert "damaged" in str(e), (position, str(e))
            continue
        # a flip in the few bytes that mark the digest leaves the zip, with its CRCs, to check
        assert position >= size - 17 - 64 - 2, f"byte {position} flipped, and the file loaded"
        assert state["step"] == 3 and torch.equal(state["w"], original["w"])


def _central_entry(data: bytes, suffix: str) -> int:
    """Where the central-directory entry of the zip member whose name ends with ``suffix`` starts."""
    position = data.rfind(suffix.encode())  # the directory comes after the members' own headers
    start = data.rfind(b"PK\x01\x02", 0, position)
    assert start >= 0 and data[start + 46 : position + len(suffix)].endswith(suffix.encode())
    return start


def test_a_flip_the_zip_crcs_miss_is_refused(tmp_path: Path) -> None:
    # A flipped bit in the directory's attributes of a tensor's member: zipfile.testzip() passes,
    # and torch.load read that tensor as zeros.
    path = save_checkpoint({"step": 3, "w": torch.randn(64)}, checkpoint_path(tmp_path, 3))
    data = path.read_bytes()
    copy = _flipped(path, _central_entry(data, "data/0") + 38, 0x10)  # the "directory" attribute
    with zipfile.ZipFile(copy) as archive:
        assert archive.testzip() is None  # what the CRCs say
    with pytest.raises(
        ValueError, match=r"cannot be read: it is damaged \(its SHA-256 digest does not match"
    ):
        load_checkpoint(copy)


def test_a_damaged_directory_without_a_digest_is_called_damaged_not_intact(tmp_path: Path) -> None:
    # A checkpoint written before the digest: a byte flipped in the zip's directory that zipfile
    # does not read (the zip64 record's entry count) was refused as "intact, but its tensors cannot
    # be loaded".
    path = checkpoint_path(tmp_path, 3)
    torch.save({"format": "torchfold.checkpoint", "version": 1, "step": 3}, path)
    data = path.read_bytes()
    copy = _flipped(path, data.rfind(b"PK\x06\x06") + 24, 0xFF)  # entries in this part of the archive
    with zipfile.ZipFile(copy) as archive:
        assert archive.testzip() is None  # what the CRCs say
    with pytest.raises(ValueError) as info:
        load_checkpoint(copy)
    message = str(info.value)
    assert message.startswith(
        f"checkpoint {copy} cannot be read: it is damaged (torch cannot read its archive"
    )
    assert "intact" not in message and "map_location" not in message
    assert load_checkpoint(path)["step"] == 3  # intact, it loads


def test_a_file_that_is_no_checkpoint_says_so_without_torchs_advice(tmp_path: Path) -> None:
    # torch's message advised loading the file with weights_only=False: arbitrary code from a
    # file that is not what it should be.
    for damage in (_garbage, _opaque):
        path = tmp_path / f"{damage.__name__}.pt"
        damage(path)
        with pytest.raises(ValueError) as info:
            load_checkpoint(path)
        message = str(info.value)
        assert message.startswith(f"checkpoint {path} cannot be read: it ")
        assert "not a torchfold checkpoint" in message
        assert "delete it (or point to another checkpoint) and start without resuming" in message
        for advice in ("weights_only", "Re-running", "trusted source", "WeightsUnpickler"):
            assert advice not in message, message


def test_a_checkpoint_under_another_steps_name_is_refused_naming_both(tmp_path: Path) -> None:
    # A step-29 checkpoint copied to step-00000999.pt was taken for the newest (and kept by
    # pruning), so every run went back to step 29.
    path = save_checkpoint({"step": 29}, checkpoint_path(tmp_path, 29))
    copy = tmp_path / "step-00000999.pt"
    copy.write_bytes(path.read_bytes())
    assert latest_checkpoint(tmp_path) == copy
    with pytest.raises(ValueError) as info:
        load_checkpoint(copy)
    assert str(info.value) == (
        f"checkpoint {copy} holds step 29, but its name says step 999: it was renamed or copied, and resuming "
        f"and pruning go by the name; delete it ({path} holds step 29 under its own name)"
    )
    path.unlink()
    with pytest.raises(ValueError, match=f"; rename it to {re.escape(str(path))}, or delete it$"):
        load_checkpoint(copy)
    assert load_checkpoint(copy.rename(path))["step"] == 29  # renamed as told, it loads


def test_the_cli_refuses_a_checkpoint_whose_name_says_another_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = small_run(tmp_path, "--workers", "0", "--checkpoint-dir", str(tmp_path / "ck"))
    assert train([*args, "--max-steps", "1"]) == 0
    copy = tmp_path / "ck" / "step-00000999.pt"
    copy.write_bytes((tmp_path / "ck" / "step-00000001.pt").read_bytes())
    capsys.readouterr()
    assert train([*args, "--max-steps", "2"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"torchfold train: error: checkpoint {copy} holds step 1, but its name says step 999"
    )


def test_a_write_killed_half_way_leaves_a_temporary_file_the_next_run_removes(tmp_path: Path) -> None:
    # A kill during a write left `.step-N.pt.tmp-PID`, as large as a checkpoint, that no run removed.
    directory = tmp_path / "ck"
    kill = (
        "import os, signal, sys, torch\n"
        "from torchfold.train.loop.checkpoint import checkpoint_path, save_checkpoint\n"
        "os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # killed with its data written\n"
        "save_checkpoint({'step': 5, 'w': torch.ones(1000)}, checkpoint_path(sys.argv[1], 5))\n"
    )
    child = subprocess.run([sys.executable, "-c", kill, str(directory)], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    [left] = directory.iterdir()
    assert re.fullmatch(r"\.step-00000005\.pt\.tmp-\d+", left.name) and left.stat().st_size > 4000
    ours = directory / f".step-00000006.pt.tmp-{os.getpid()}"  # a write of this process: not touched
    ours.write_bytes(b"")
    (directory / ".step-7.pt.tmp-x").write_bytes(b"")  # not a name save_checkpoint writes
    with CheckpointDirLock(directory) as lock:
        assert lock.removed == [left]
    assert sorted(p.name for p in directory.iterdir()) == sorted([".lock", ours.name, ".step-7.pt.tmp-x"])
