"""Checkpoints: atomic writes, weights-only loads, generator states, and clear errors for bad files."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from _loop_worker import make_trainer, sst_trees
from _train_cli import run_train, small_run, train

from torchfold.train.checkpoint import (
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
        (_truncated, "cannot be read: it is truncated or corrupt"),
        (_garbage, "cannot be read: it is truncated or corrupt"),
        (_empty, "cannot be read: it is truncated or corrupt"),
        (_opaque, "holds objects other than tensors and plain containers"),
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
    return save_checkpoint(state, tmp_path / saved.name)


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
