"""Running the training command: one fresh process per run, its record, and the archive in the loop.

:func:`run_command` starts one run with its stdout/stderr in its folder; :func:`require_ok` turns a
failed run or a broken contract into :class:`~ckpt_archive.errors.SourceError`; :func:`load_checkpoint`
reads a run's ``checkpoint.pt`` (``weights_only=True``, never unpickling); :class:`ArchiveLoop` carries
the interruption checkpoint through ckpt-archive (pack, deep verify, restore, load).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from ckpt_archive.errors import IntegrityError, OutputExists, RefusedPickle, SourceError, UsageError
from ckpt_archive.resume.trajectory import CHECKPOINT_FILE


@dataclasses.dataclass
class RunRecord:
    """One training process: its argv, where it wrote, how it ended."""

    name: str
    argv: list[str]
    output: Path
    exit_code: int | None = None
    seconds: float = 0.0
    timed_out: bool = False

    def stderr_tail(self, lines: int = 5) -> str:
        """The end of the run's stderr in one line: a Python crash's exception and where it was raised,
        else the last ``lines`` lines joined with `` | `` (``""`` when there is no log)."""
        try:
            text = (self.output / "stderr.log").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)
        tb = text.rfind("Traceback (most recent call last):")
        if tb >= 0:
            # A Python crash: the exception line and where it was raised, not the traceback's carets.
            body = text[tb:].splitlines()
            at = [i for i, ln in enumerate(body) if re.match(r'\s*File "(.*)", line (\d+)', ln)]
            tail = body[at[-1] + 1:] if at else body[1:]
            exc = " ".join(ln.strip() for ln in tail if ln.strip() and not ln[:1].isspace())
            frames = [re.match(r'\s*File "(.*)", line (\d+)', body[i]) for i in at]
            if exc:
                return exc + (f" (at {frames[-1].group(1)}:{frames[-1].group(2)})" if frames else "")
        return " | ".join(text.strip().splitlines()[-lines:])

    def to_json(self) -> dict:
        """The run as in ``verification.json``'s ``runs``."""
        return {"name": self.name, "argv": self.argv, "output": str(self.output), "exit_code": self.exit_code,
                "seconds": round(self.seconds, 3), "timed_out": self.timed_out}


def run_command(name: str, argv: list[str], output: Path, *, timeout: float | None, env: dict) -> RunRecord:
    """Run ``argv`` in a fresh process with stdout/stderr logged into ``output`` (created; must not exist).

    Args:
        timeout: seconds; a run past it is killed and recorded with ``timed_out``.

    Raises:
        UsageError: the command is not found or not executable.
    """
    output.mkdir(parents=True, exist_ok=False)
    rec = RunRecord(name, argv, output)
    t0 = time.monotonic()
    with open(output / "stdout.log", "wb") as out, open(output / "stderr.log", "wb") as err:
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                  timeout=timeout)
            rec.exit_code = proc.returncode
        except subprocess.TimeoutExpired:
            rec.timed_out = True
        except FileNotFoundError:
            raise UsageError(f"command not found: {argv[0]!r}", where=f"run {name}") from None
        except PermissionError:
            raise UsageError(f"command not executable: {argv[0]!r}", where=f"run {name}") from None
    rec.seconds = time.monotonic() - t0
    return rec


def require_ok(rec: RunRecord) -> None:
    """Raise :class:`SourceError` unless the run exited 0 in time and wrote its ``checkpoint.pt``."""
    if rec.timed_out:
        raise SourceError(f"run '{rec.name}' timed out after {rec.seconds:.0f} s; log: {rec.output / 'stderr.log'}")
    if rec.exit_code != 0:
        tail = rec.stderr_tail()
        raise SourceError(f"run '{rec.name}' exited {rec.exit_code}"
                          + (f": {tail}" if tail else "") + f" (full log: {rec.output / 'stderr.log'})")
    if not (rec.output / CHECKPOINT_FILE).is_file():
        raise SourceError(f"run '{rec.name}' wrote no {CHECKPOINT_FILE} into its {{output}} folder "
                          "(the contract: the script saves its state there after its last update)",
                          where=str(rec.output))


def load_checkpoint(path: Path) -> Any:
    """A run's checkpoint, loaded with ``torch.load(weights_only=True)`` on CPU.

    Raises:
        SourceError / RefusedPickle: unreadable, or it needs unpickling (the refused global is named,
            with what to save instead).
    """
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reason is reported with the file
        from ckpt_archive.sources.torchfile import diagnose_unreadable

        # torch's own first line ("Weights only load failed. ...") never names the refused global.
        err = diagnose_unreadable(path, exc)
        if isinstance(err, RefusedPickle):
            hint = ("the contract: checkpoint.pt must load with torch.load(weights_only=True), as the "
                    "resumed script loads it; save plain data: dicts, lists, numbers, strings, tensors")
            if "numpy" in err.message:
                hint += (" (np.random.Generator: bit_generator.state; the legacy np.random.get_state() "
                         "tuple with its array as .tolist())")
            err.hint = hint
        raise err from None


class ArchiveLoop:
    """Carries the interruption checkpoint through ckpt-archive: pack, deep verify, restore, load.

    Args:
        repo: the archive repository (a folder or fsspec URL); created by :func:`ckpt_archive.pack`.
    """

    def __init__(self, repo: str | os.PathLike):
        self.repo = str(repo)
        self.generation: int | None = None

    def store(self, checkpoint: Path, *, step: int | None, data_ids: Any = None) -> dict:
        """Pack ``checkpoint`` (with ``data_ids`` when given) as a new generation and verify it deeply.

        Returns:
            ``{"repository", "generation", "status", "verified"}``.

        Raises:
            IntegrityError: the new generation failed verification.
        """
        import ckpt_archive
        from ckpt_archive.ops.pack import Annotations

        res = ckpt_archive.pack(str(checkpoint), self.repo, annotations=Annotations(
            tags=("check-resume",), progress={"step": step} if step is not None else None, data_ids=data_ids))
        self.generation = int(res.generation)
        rep = ckpt_archive.verify(self.repo, str(self.generation), ckpt_archive.VerifyOptions(deep=True))
        if not rep.ok:
            reasons = "; ".join(f"{p.member or ''} {p.field or ''}: {p.reason}".strip() for p in rep.problems)
            raise IntegrityError(f"the archived interruption checkpoint failed verification: {reasons}",
                                 where=f"{self.repo}@{self.generation}")
        return {"repository": self.repo, "generation": self.generation, "status": str(res.status),
                "verified": True}

    def check_data_ids(self, session_ids: Any, *, allow_change: bool = False) -> dict:
        """Compare the resuming session's data ids with those stored with the generation
        (:func:`ckpt_archive.ops.data_identity.check_data_ids`; raises DataIdentityMismatch on a difference)."""
        from ckpt_archive.ops.data_identity import check_data_ids

        return check_data_ids(self.repo, str(self.generation), session_ids, allow_change=allow_change)

    def restore(self, output: Path) -> Path:
        """Restore the stored generation to the ``.pt`` file ``output`` (which must not exist)."""
        import ckpt_archive

        ckpt_archive.restore(self.repo, str(self.generation), output=str(output))
        return output

    def load(self) -> Any:
        """The stored state as a nested Python object (tensors, dicts, tuples, ints...)."""
        import ckpt_archive

        return ckpt_archive.load(self.repo, str(self.generation))


def prepare_output(output: str | os.PathLike | None, *, default_prefix: str) -> Path:
    """Create the output folder; refuse an existing non-empty one (a proof is never overwritten).

    Args:
        output: the folder; ``None`` makes ``./<default_prefix>-<UTC timestamp>``.

    Raises:
        OutputExists: the folder exists and is not empty.
    """
    if output is None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        out = Path(f"{default_prefix}-{stamp}")
        n = 1
        while out.exists():
            n += 1
            out = Path(f"{default_prefix}-{stamp}-{n}")
    else:
        out = Path(output)
    if out.exists():
        if not out.is_dir():
            raise OutputExists("exists and is not a folder; give a new --output", where=str(out))
        if any(out.iterdir()):
            raise OutputExists("folder exists and is not empty; an earlier proof is never overwritten: "
                               "give a new --output", where=str(out))
    out.mkdir(parents=True, exist_ok=True)
    return out.resolve()


def run_name(control: str) -> str:
    """The run (and folder) name of a control: ``control-<name>`` with unsafe characters replaced."""
    return "control-" + (re.sub(r"[^A-Za-z0-9_.-]+", "_", control).strip("_") or "script")


__all__ = ["RunRecord", "run_command", "require_ok", "load_checkpoint", "ArchiveLoop", "prepare_output", "run_name"]
