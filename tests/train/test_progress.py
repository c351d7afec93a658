"""A run's lines: records of the torchfold logger where no log= is given."""

from __future__ import annotations

import logging

import pytest
from _loop_worker import make_trainer, sst_trees

from torchfold.train.loop.progress import LOGGER


def test_without_log_the_lines_are_records_of_the_torchfold_logger(caplog: pytest.LogCaptureFixture) -> None:
    trainer = make_trainer(sst_trees(), log_every=2)
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        trainer.fit(max_steps=2)
    lines = [r.getMessage() for r in caplog.records if r.name == "torchfold"]
    assert any(line.startswith("step 2/2 | epoch 0 | ") for line in lines)
