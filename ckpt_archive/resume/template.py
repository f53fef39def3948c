"""The command template of ``check-resume``: the contract's placeholders and how a run's argv is made.

A training command is given once, as a template (see docs/check-resume.md): ``{steps}`` (the updates
this run adds), ``{output}`` (the run's folder) and a ``{resume}`` form (the checkpoint to resume
from, dropped when the run starts from scratch).
"""
from __future__ import annotations

import os
import re
import shlex
from typing import Sequence

from ckpt_archive.errors import UsageError

_RESUME_TEMPLATE = re.compile(r"^\{resume:(.*)\}$", re.S)


def check_template(template: Sequence[str]) -> None:
    """Check that a command template carries the three placeholders of the contract.

    Raises:
        UsageError: empty command, or ``{steps}`` (or ``{total_steps}``), ``{output}`` or a ``{resume}`` form
            missing.
    """
    if not template:
        raise UsageError("no training command given: put it after '--', e.g. "
                         "-- python train.py --steps {steps} --output {output} {resume:--resume-from {}}")
    joined = "\x00".join(template)
    missing = [] if "{steps}" in joined or "{total_steps}" in joined else ["{steps} (or {total_steps})"]
    missing += [p for p in ("{output}",) if p not in joined]
    if "{resume}" not in joined and not any(_RESUME_TEMPLATE.match(a) for a in template):
        missing.append("{resume} (or '{resume:--resume-from {}}')")
    if missing:
        raise UsageError(f"the command template lacks {', '.join(missing)}; see docs/check-resume.md")


def expand_command(template: Sequence[str], *, steps: int, output: str | os.PathLike,
                   resume: str | os.PathLike | None, total_steps: int | None = None) -> list[str]:
    """Fill a command template for one run.

    * ``{steps}``: the number of optimizer updates this run adds; ``{total_steps}``: the global update
      number this run ends at (for scripts whose ``--steps`` is the total: a resumed run continues to
      it; defaults to ``steps``); ``{output}``: the run's folder.
    * An argument holding ``{resume}`` (e.g. ``--resume-from={resume}``) is filled with the checkpoint
      path when the run resumes, and **dropped entirely** when it does not.
    * An argument that is exactly ``{resume:TEMPLATE}`` expands, when resuming, to ``TEMPLATE`` split
      like a shell would, with ``{}`` replaced by the path (``'{resume:--resume-from {}}'`` gives two
      arguments ``--resume-from PATH``); it vanishes when not resuming.

    Example:
        >>> expand_command(["t.py", "--n", "{steps}", "{resume:--from {}}"], steps=5, output="o", resume=None)
        ['t.py', '--n', '5']
        >>> expand_command(["t.py", "{resume:--from {}}"], steps=5, output="o", resume="c.pt")
        ['t.py', '--from', 'c.pt']
    """
    def fill(s: str) -> str:
        total = steps if total_steps is None else total_steps
        return (s.replace("{total_steps}", str(total)).replace("{steps}", str(steps))
                .replace("{output}", str(output)))

    argv: list[str] = []
    for arg in template:
        m = _RESUME_TEMPLATE.match(arg)
        if m:
            if resume is not None:
                argv.extend(fill(part).replace("{}", str(resume)) for part in shlex.split(m.group(1)))
            continue
        if "{resume}" in arg:
            if resume is None:
                continue
            arg = arg.replace("{resume}", str(resume))
        argv.append(fill(arg))
    return argv


__all__ = ["check_template", "expand_command"]
