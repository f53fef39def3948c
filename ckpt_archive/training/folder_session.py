"""``--policy session`` on a folder source: the session's LR imposed on each optimizer/scheduler file pair.

An HF Trainer folder keeps ``optimizer.pt`` and ``scheduler.pt``; an Accelerate folder ``optimizer.bin``,
``scheduler.bin`` and, per further optimizer, ``optimizer_1.bin``, ``scheduler_1.bin``.
:func:`session_folder_rewrite` builds the rewrite that :func:`ckpt_archive.ops.folder_policy.rewrite_folder_files`
runs while the folder is restored: the files are found and paired as the audit finds and pairs them
(:func:`~ckpt_archive.training.parts.find_parts`, by their ``_<n>`` suffix), the pair's states go
through :func:`~ckpt_archive.training.session.apply_session_policy` together, and only files with a
changed field are written back. A session config equal to the archived one changes nothing, so every
file stays byte-identical.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ckpt_archive.errors import UsageError
from ckpt_archive.format.state_path import StatePath
from ckpt_archive.ops.folder_policy import FileRewrite, FolderRewrite
from ckpt_archive.training.parts import find_parts, sub_checkpoints
from ckpt_archive.training.session import PolicyChange, apply_session_policy


def session_folder_rewrite(session_config: dict | str | Path) -> FolderRewrite:
    """The folder rewrite that re-imposes ``session_config`` (``restore --policy session`` on a folder).

    Args:
        session_config: the session's config (dict or JSON/YAML/TOML path; see
            :func:`~ckpt_archive.training.session.session_values`).

    Returns:
        A :data:`~ckpt_archive.ops.folder_policy.FolderRewrite`. Its report holds ``changes`` (one
        :meth:`PolicyChange.to_json` per rewritten field, the field named with its file, e.g.
        ``["optimizer_1.bin"].param_groups[0].lr``) and ``notes``.

    Raises (when run):
        UsageError: the folder holds no optimizer or scheduler state; as many LRs as neither 1 nor the
            number of param groups; an optimizer/scheduler file that is not a torch file.
        SourceError: unreadable config file.
    """

    def rewrite(stub_state: dict, load: Callable[[str], Any]) -> tuple[list[FileRewrite], dict]:
        parts = find_parts(stub_state)
        relpaths: list[str] = []
        for path, _ in parts.get("optimizer", []) + parts.get("scheduler", []):
            if len(path) and path[0] not in relpaths:
                relpaths.append(path[0])
        if not relpaths:
            raise UsageError("--policy session: this folder source holds no optimizer or scheduler state: there "
                             "is no policy to rewrite")
        notes = []
        subs = sub_checkpoints(stub_state)
        if subs:
            notes.append(f"{len(subs)} sub-checkpoints ({', '.join(subs)}): rewrote the newest, "
                         f"{', '.join(relpaths)}, as the audit reads it")
        # the chosen files together: find_parts pairs optimizer_<n> with scheduler_<n> as the audit does
        sub = {rp: load(rp) for rp in relpaths}
        new, changes = apply_session_policy(sub, session_config=session_config)
        by_file: dict[str, list[str]] = {rp: [] for rp in relpaths}
        for c in changes:
            by_file[_file_of(c, relpaths)].append(_field_in_file(c.field, _file_of(c, relpaths)))
        rewrites = [FileRewrite(rp, new[rp], fields) for rp, fields in by_file.items() if fields]
        return rewrites, {"changes": [c.to_json() for c in changes], "notes": notes}

    return rewrite


def _prefix(relpath: str) -> str:
    return str(StatePath((relpath,)))


def _file_of(change: PolicyChange, relpaths: list[str]) -> str:
    """The file a change's field lies in (its field starts with the file's path)."""
    for rp in sorted(relpaths, key=len, reverse=True):
        p = _prefix(rp)
        if change.field == p or change.field.startswith(p + ".") or change.field.startswith(p + "["):
            return rp
    raise UsageError(f"--policy session changed {change.field!r}, which lies in none of the files "
                     f"{', '.join(relpaths)}; nothing was written")


def _field_in_file(field: str, relpath: str) -> str:
    """``["optimizer_1.bin"].param_groups[0].lr`` -> ``param_groups[0].lr``."""
    return field[len(_prefix(relpath)):].lstrip(".") or field


__all__ = ["session_folder_rewrite"]
