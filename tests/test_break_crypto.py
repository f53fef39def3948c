"""Attacks on issue 28's keys, encrypted repositories and signatures that the first suites missed.

Each test names the fault it guards against; see the docstrings.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import UsageError
from ckpt_archive.format import crypto
from ckpt_archive.repo.repository import Repository


@pytest.fixture()
def keyfile(tmp_path) -> Path:
    p = tmp_path / "repo.key"
    p.write_bytes(crypto.new_key_file_text())
    return p


def _state(step: int = 1) -> dict:
    return {"model": {"w": torch.arange(16, dtype=torch.float32) + step}, "progress": {"step": step}}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_key_file_that_is_a_fifo_is_refused_not_waited_on_forever(tmp_path, keyfile):
    """--key-file PATH naming a FIFO hung every command in open() (waiting for a writer that never came)."""
    ckpt_archive.pack(_state(), Repository.open(tmp_path / "r", create=True, key_file=keyfile))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    box = {}

    def attempt():
        try:
            Repository.open(tmp_path / "r", key_file=fifo)
        except Exception as exc:  # noqa: BLE001 - recorded and asserted below
            box["exc"] = exc

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # unblock the hung open() so the test run can end
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail("opening a FIFO as a key file waited for a writer")
    assert isinstance(box.get("exc"), UsageError) and "not a regular file" in box["exc"].message
    with pytest.raises(UsageError, match="not a regular file"):
        Repository.open(tmp_path / "r", key_file=tmp_path)  # a directory: the same refusal
