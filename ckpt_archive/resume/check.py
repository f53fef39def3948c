"""Resume correctness as a check: continuous vs interrupted + archived + resumed runs, and negative controls.

:func:`check_resume` runs a user's training command (a template with ``{steps}``, ``{output}`` and a
``{resume}`` form, see ``docs/check-resume.md``) in fresh processes:

1. **continuous**: ``steps`` updates from scratch;
2. **interrupted**: ``interrupt_at`` updates from scratch; its final ``checkpoint.pt`` is the resume
   point. It is *packed into an archive repository, verified (deep) and restored* through
   ckpt-archive before anything reads it: the archive is in the loop;
3. **resumed**: ``steps - interrupt_at`` more updates from the restored checkpoint;
4. **negative controls**: the same resume from a deliberately broken state. Tool-made controls load
   the archived state (:func:`ckpt_archive.load`), perturb one part in a type-preserving way (each RNG
   stream replaced by another valid state, optimizer moments zeroed, scheduler one step stale, data
   cursor shifted) and ``torch.save`` it for the run; script-side controls pass extra arguments
   (e.g. ``--omit-rng-restore``). Every control must diverge, otherwise the check could not have
   seen that fault.

Each run writes ``checkpoint.pt`` and ``trajectory.json`` (:mod:`ckpt_archive.resume.trajectory`) into its
``{output}``. Runs are compared per update and per field (sample ids, LR of every param group, loss)
with ``atol``/``rtol``, then the final states (``model``, ``optimizer``, ``scheduler``, ``rng``,
``data``, ``progress``) leaf by leaf and the next draws of every random stream. Non-finite values and
structure differences are flagged, never accepted silently. The result is ``verification.json``
(``schemas/verification.v1.schema.json``), validated before it is written.

Errors: :class:`~ckpt_archive.errors.UsageError` (bad arguments), :class:`~ckpt_archive.errors.OutputExists`,
:class:`~ckpt_archive.errors.SourceError` (a run failed or broke the contract) -> exit 2. A failed
comparison is *not* raised: :func:`check_resume` returns the report and ``report["all_checks_passed"]``
says whether it passed (the CLI exits 1 when it did not).

Where things are: the command template in :mod:`~ckpt_archive.resume.template`, running it in
:mod:`~ckpt_archive.resume.runner`, the negative controls in :mod:`~ckpt_archive.resume.controls`, the
comparison in :mod:`~ckpt_archive.resume.compare`, ``verification.json`` in
:mod:`~ckpt_archive.resume.report`; this module puts them in order.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from ckpt_archive.errors import CannotCheck, IntegrityError, SourceError, UsageError
from ckpt_archive.resume.compare import (MAX_LISTED, TreeDiff, compact, compare_runs, compare_trajectories,
                                         data_ids_differences, describe, ids_named, short_value, span)
from ckpt_archive.resume.controls import (CONTROL_LABELS, STREAMS, TOOL_CONTROLS, canonical_control, control_verdict,
                                          perturb, script_control_name)
from ckpt_archive.resume.report import (REPORT_FILE, build_report, draw_picture, interruption_facts, record_last_check,
                                        write_report)
from ckpt_archive.resume.runner import (ArchiveLoop, RunRecord, load_checkpoint, prepare_output, require_ok,
                                        run_command, run_name)
from ckpt_archive.resume.template import check_template, expand_command
from ckpt_archive.resume.trajectory import CHECKPOINT_FILE, TRAJECTORY_FILE, load_trajectory

Event = Callable[[str], None]


def check_resume(command: Sequence[str], *, steps: int, interrupt_at: int | Sequence[int],
                 output: str | os.PathLike | None = None,
                 atol: float = 1e-12, rtol: float = 0.0, controls: Sequence[str] | None = None,
                 expect_no_effect: Sequence[str] = (), script_controls: Sequence[Sequence[str] | str] = (),
                 jobs: int = 1, timeout: float | None = None, env: dict | None = None,
                 on_event: Event | None = None, kind: str = "check-resume",
                 archive_loop: ArchiveLoop | None = None, data_ids: Any = None, resume_data_ids: Any = None,
                 allow_data_change: bool = False) -> dict:
    """Run the resume check and write ``verification.json`` into ``output``.

    Args:
        command: the command template (argv list) with ``{steps}`` (or ``{total_steps}``), ``{output}`` and
            a ``{resume}`` form (see :func:`expand_command`).
        steps: total optimizer updates of the continuous run (> every interruption).
        interrupt_at: updates before the interruption (>= 1), or several (``[30, 40]``): the run is
            interrupted, archived, restored and resumed at each, in order.
        output: a new or empty folder; default ``./ckpt-archive-check-resume-<UTC timestamp>``.
        atol / rtol: tolerance for floats: ``|expected - got| <= atol + rtol * |expected|``.
        controls: tool-made controls to run (names or aliases, see :data:`TOOL_CONTROLS`); all by
            default, ``[]`` for none. They resume from the last interruption.
        expect_no_effect: controls declared unused (``numpy``: the script draws nothing from NumPy):
            a control that changes nothing is then accepted.
        script_controls: extra arguments (a string split like a shell, or a list) appended to the
            resumed command for each script-side control, e.g. ``"--omit-rng-restore"``.
        jobs: how many control runs at once (each is a separate process).
        timeout: seconds per run; ``None`` for no limit.
        env: environment for the runs (default: this process's, with ``PYTHONHASHSEED=0`` unless set).
        on_event: called with one human line per phase (progress on stderr in the CLI).
        kind: ``"check-resume"`` or ``"demo"``, recorded in the report.
        archive_loop: where the interruption checkpoints go (default: a repository ``archive/`` in
            ``output``).
        data_ids: the run's data identity (value or JSON/YAML/TOML/.txt path), packed with every
            interruption checkpoint.
        resume_data_ids: the resuming session's data ids, compared with the archived ones at every restore
            (default: ``data_ids``); a difference refuses the resume (:class:`DataIdentityMismatch`, exit 1).
        allow_data_change: resume although the data ids differ (reported as a warning).

    Returns:
        the report written to ``verification.json`` (see ``schemas/verification.v1.schema.json``);
        ``report["all_checks_passed"]`` is the verdict.

    Raises:
        UsageError: bad arguments or command template.
        OutputExists: ``output`` exists and is not empty.
        SourceError: a run failed, timed out, or broke the contract (no checkpoint/trajectory, wrong
            number of updates); the resumed run or a control run failed: the check could not be carried
            out (the run's error line is in the message; the report, when one was written, says so too).
        IntegrityError: the archived interruption checkpoint failed verification.
        DataIdentityMismatch: the resuming session's data ids differ from the archived ones.
    """
    say = on_event or (lambda s: None)
    command = list(command)
    points = _interruptions(interrupt_at, steps)
    chosen, no_effect, scripted = _check_arguments(command, steps=steps, interrupt_at=points[0], atol=atol,
                                                   rtol=rtol, jobs=jobs, controls=controls,
                                                   expect_no_effect=expect_no_effect, script_controls=script_controls)
    out = prepare_output(output, default_prefix=f"ckpt-archive-{kind}")
    run_env = _run_environment(env)
    resume_dir = out / "resume"
    resume_dir.mkdir()
    runs = _Runs(command, out / "runs", timeout, run_env, ThreadPoolExecutor(max_workers=jobs))
    t_start = time.monotonic()
    ids = _DataIds(data_ids, resume_data_ids, allow_data_change)
    try:
        say(f"running continuous ({steps} updates) and interrupted ({points[0]} updates) in fresh processes")
        cont, intr, cont_traj, int_traj, determinism = _run_baselines(runs, steps, points[0], atol, rtol)

        loop = archive_loop or ArchiveLoop(out / "archive")
        trips, segments, res = _resume_segments(runs, loop, intr, points, steps, resume_dir, ids, say)
        resumed_line = {"updates": [u for seg in segments for u in seg["updates"]], "final": segments[-1].get("final")}
        line = list(int_traj["updates"]) + resumed_line["updates"]  # the interrupted+resumed run, update by update
        cont_state = load_checkpoint(cont.output / CHECKPOINT_FILE)
        res_state = load_checkpoint(res.output / CHECKPOINT_FILE)
        positive = compare_runs(cont_traj, resumed_line, cont_state, res_state, interrupt_at=points[0],
                                atol=atol, rtol=rtol, prefix=int_traj["updates"], name="resumed",
                                ignore_streams={STREAMS[c] for c in no_effect if c in STREAMS})
        positive_ok = positive["matched"] and determinism["matched"]
        # the controls resume from the last interruption, and run only when the resume itself is exact
        baseline = _Baseline(cont_traj, cont_state, line[:points[-1]], trips[-1]["restored"], steps - points[-1],
                             points[-1], atol, rtol)
        entries = (_run_controls(runs, baseline, trips[-1]["archived_state"], chosen, scripted, no_effect,
                                 resume_dir, say) if positive_ok else _not_run(chosen, scripted))
    finally:
        runs.pool.shutdown(wait=True)

    interruptions, verdict = _verdict_of_runs(determinism, positive, positive_ok, entries, trips, points, cont_traj,
                                              segments, run_env, ids)
    report = build_report(kind=kind, command=command, steps=steps, interrupt_at=points[0], atol=atol, rtol=rtol,
                          verdict=verdict, positive=positive, determinism=determinism, entries=entries,
                          facts=trips[0]["facts"],
                          trajectories={"continuous": cont_traj, "interrupted": int_traj, "resumed": resumed_line},
                          states={"continuous": cont_state, "resumed": res_state}, archive=trips[-1]["archive"],
                          records=runs.records, seconds=time.monotonic() - t_start, output=out)
    report["interrupt_points"] = points
    report["interruptions"] = interruptions
    if ids.checks:
        report["data_ids"] = ids.checks
    _publish(report, runs, entries, loop, out, {"continuous": cont_traj, "resumed": {"updates": line}})
    return report


def _run_environment(env: dict | None) -> dict:
    """The runs' environment: ``env`` (default this process's), with ``PYTHONHASHSEED=0`` unless set, and without
    the ``OPENBLAS_NUM_THREADS`` the CLI set for its own process (``cli/app.py: quiet_blas_threads``): a training
    run gets the thread count its user gave it, or none."""
    run_env = dict(os.environ if env is None else env)
    if run_env.pop("CKPT_ARCHIVE_SET_OPENBLAS_NUM_THREADS", None) is not None:
        run_env.pop("OPENBLAS_NUM_THREADS", None)
    run_env.setdefault("PYTHONHASHSEED", "0")
    return run_env


def _resume_segments(runs: _Runs, loop: ArchiveLoop, interrupted, points: list[int], steps: int, resume_dir: Path,
                     ids: _DataIds, say: Event) -> tuple[list[dict], list[dict], Any]:
    """At each interruption point in turn: pack the previous run's checkpoint into the archive, verify and
    restore it, and resume from the restored file up to the next point (the last one up to ``steps``).

    Returns:
        the round trips (one per point), the resumed segments' trajectories, and the last resumed run.

    Raises:
        SourceError: a resumed run failed or ran another number of updates than asked.
        IntegrityError / DataIdentityMismatch: from the archive round trip.
    """
    segments: list[dict] = []
    trips: list[dict] = []
    prev = interrupted
    for k, point in enumerate(points):
        last = k == len(points) - 1
        end = steps if last else points[k + 1]
        say(f"packing the interruption checkpoint (update {point}) into the archive, verifying, restoring")
        trip = _archive_round_trip(loop, prev, point, resume_dir, ids,
                                   name="restored.pt" if last else f"restored-at-{point}.pt")
        trips.append(trip)
        name = "resumed" if last else f"resumed-{k + 1}"
        say(f"resuming from the restored checkpoint for {end - point} more updates (to update {end})")
        prev = runs.launch(name, end - point, trip["restored"], total=end)
        require_ok(prev)
        seg = load_trajectory(prev.output)
        _require_update_count(prev, seg, end - point, point)
        segments.append(seg)
    return trips, segments, prev


def _verdict_of_runs(determinism: dict, positive: dict, positive_ok: bool, entries: list[dict], trips: list[dict],
                     points: list[int], cont_traj: dict, segments: list[dict], run_env: dict,
                     ids: _DataIds) -> tuple[list[dict], dict]:
    """The facts at each interruption (with the continuous run's cursor there) and the verdict over every
    comparison, control and data-id check."""
    interruptions = [dict(t["facts"], at=p, expected_cursor=_expected_cursor(cont_traj, p, t["facts"].get("epoch")))
                     for t, p in zip(trips, points)]
    verdict = _verdict(determinism, positive, positive_ok, entries, trips[0]["facts"], points[0], interruptions,
                       resumed_ids=[(seg_name, data_ids_differences(cont_traj.get("data_ids"), seg.get("data_ids"),
                                                                    "continuous", seg_name))
                                    for seg_name, seg in zip(_segment_names(points), segments)],
                       hash_seed=run_env.get("PYTHONHASHSEED"))
    verdict["warnings"] += ids.warnings
    return interruptions, verdict


def _publish(report: dict, runs: _Runs, entries: list[dict], loop: ArchiveLoop, out: Path,
             trajectories: dict[str, dict]) -> None:
    """Draw the picture, write ``verification.json``, record the check on the repository; then refuse if a
    control could not be checked.

    Raises:
        SourceError: a control run failed (the report names it and is written first).
    """
    # [issue 26] a picture next to the report: loss and LR per update of every run, divergences marked
    report["picture"] = draw_picture(report, trajectories, _control_trajectories(runs, entries), out)
    write_report(report, out / REPORT_FILE)
    record_last_check(loop.repo, report)
    failed = [e for e in entries if e["status"] == "could-not-check"]
    if failed:
        raise SourceError("; ".join(e["message"] for e in failed)
                          + f" (report: {out / REPORT_FILE})")


def _control_trajectories(runs: _Runs, entries: list[dict]) -> dict[str, dict]:
    """Each control run's trajectory (its updates after the last interruption), by control name; a control
    whose run left none (it crashed, or did not run) is left out."""
    by_run = {rec.name: rec for rec in runs.records}
    found: dict[str, dict] = {}
    for e in entries:
        rec = by_run.get(run_name(e["name"]))
        if rec is not None and (rec.output / TRAJECTORY_FILE).is_file():
            try:
                found[e["name"]] = load_trajectory(rec.output)
            except (SourceError, OSError, ValueError):
                continue
    return found


def _interruptions(interrupt_at: int | Sequence[int], steps: int) -> list[int]:
    """The interruption points, in order.

    Raises:
        UsageError: none given, a repeated point, or one outside ``1 <= point < steps``.
    """
    pts = [interrupt_at] if isinstance(interrupt_at, int) else list(interrupt_at)
    if not pts:
        raise UsageError("no --interrupt-at given")
    try:
        pts = [int(p) for p in pts]
    except (TypeError, ValueError):
        raise UsageError(f"--interrupt-at takes whole numbers, got {interrupt_at!r}") from None
    if len(set(pts)) != len(pts):
        raise UsageError(f"--interrupt-at repeats a point: {', '.join(map(str, pts))}")
    pts = sorted(pts)
    if pts[0] < 1 or pts[-1] >= steps:
        raise UsageError(f"need 1 <= --interrupt-at < --steps, got --interrupt-at {','.join(map(str, pts))} "
                         f"--steps {steps}")
    return pts


def _expected_cursor(cont_traj: dict, point: int, saved_epoch: int | None = None) -> int | None:
    """Samples of the current epoch the continuous run had consumed after update ``point`` (None without
    per-update epochs): what a ``data.cursor`` counting samples into the epoch must say there.

    An interruption exactly on an epoch boundary (the continuous run's next update starts epoch ``e + 1``) is
    the end of epoch ``e`` and the start of epoch ``e + 1`` alike: a checkpoint that already says epoch
    ``e + 1`` (``saved_epoch``) with cursor 0 is where the continuous run was, so 0 is expected there."""
    ups = [u for u in cont_traj["updates"] if u["step"] <= point]
    if not ups or any(u.get("epoch") is None for u in ups):
        return None
    epoch = ups[-1]["epoch"]
    nxt = [u.get("epoch") for u in cont_traj["updates"] if u["step"] == point + 1]
    if saved_epoch is not None and saved_epoch == epoch + 1 and nxt == [epoch + 1]:
        return 0
    return sum(len(u["sample_ids"]) for u in ups if u["epoch"] == epoch)


@dataclasses.dataclass
class _DataIds:
    """The data identity packed with each interruption checkpoint and compared at each restore."""

    archived: Any
    session: Any
    allow_change: bool
    checks: list = dataclasses.field(default_factory=list)
    warnings: list = dataclasses.field(default_factory=list)

    @property
    def resuming(self) -> Any:
        return self.session if self.session is not None else self.archived


def _check_arguments(command: list[str], *, steps: int, interrupt_at: int, atol: float, rtol: float, jobs: int,
                     controls: Sequence[str] | None, expect_no_effect: Sequence[str],
                     script_controls: Sequence[Sequence[str] | str]) -> tuple[list[str], set[str], list[list[str]]]:
    """Refuse bad arguments before anything runs.

    Returns:
        ``(tool controls to run, controls declared without effect, script-side controls as argv lists)``.

    Raises:
        UsageError: the template, the step counts, the tolerances, ``jobs`` or a control name is wrong.
    """
    check_template(command)
    _interruptions(interrupt_at, steps)
    if atol < 0 or rtol < 0 or not (math.isfinite(atol) and math.isfinite(rtol)):
        raise UsageError(f"tolerances must be finite and >= 0, got atol {atol} rtol {rtol}")
    if jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {jobs}")
    chosen = list(TOOL_CONTROLS) if controls is None else list(dict.fromkeys(canonical_control(c) for c in controls))
    no_effect = {canonical_control(c) for c in expect_no_effect}
    scripted = [shlex.split(s) if isinstance(s, str) else list(s) for s in script_controls]
    if any(not s for s in scripted):
        raise UsageError("an empty --script-control was given")
    return chosen, no_effect, scripted


@dataclasses.dataclass
class _Runs:
    """Starts the runs of one check (in the pool, each in a fresh process) and keeps their records."""

    command: list[str]
    runs_dir: Path
    timeout: float | None
    env: dict
    pool: ThreadPoolExecutor
    records: list[RunRecord] = dataclasses.field(default_factory=list)

    def launch(self, name: str, n: int, resume: Path | None, extra: Sequence[str] = (),
               total: int | None = None) -> RunRecord:
        """Run the command for ``n`` updates (resuming from ``resume``, ending at global update ``total``) in
        ``runs/<name>``; wait for it."""
        argv = expand_command(self.command, steps=n, output=self.runs_dir / name, resume=resume,
                              total_steps=total) + list(extra)
        rec = run_command(name, argv, self.runs_dir / name, timeout=self.timeout, env=self.env)
        self.records.append(rec)
        return rec

    def submit(self, name: str, n: int, resume: Path | None, extra: Sequence[str] = (), total: int | None = None):
        """:meth:`launch` in the pool; returns its future."""
        return self.pool.submit(self.launch, name, n, resume, extra, total)


def _wrong_update_count(rec: RunRecord, traj: dict, n: int, after: int) -> str | None:
    """Why a resumed (or control) run that was asked for ``n`` updates after update ``after`` cannot be
    compared: it recorded another number of them. None when the count is right (its step numbers are then
    part of the comparison: a resume that restores the wrong step is a divergence)."""
    got = [u["step"] for u in traj["updates"]]
    if len(got) == n:
        return None
    return (f"run '{rec.name}' recorded {len(got)} updates (steps {span(got)}) where it was asked for {n} "
            f"({after + 1}..{after + n}): a run that does not run the updates asked for cannot be compared "
            "(does the script run {steps} updates, or {total_steps} for a total, and record each one?)")


def _require_update_count(rec: RunRecord, traj: dict, n: int, after: int) -> None:
    """Raise :class:`SourceError` (could not check, exit 2) unless the run recorded ``n`` updates."""
    why = _wrong_update_count(rec, traj, n, after)
    if why:
        raise SourceError(why, where=str(rec.output / TRAJECTORY_FILE))


def _run_baselines(runs: _Runs, steps: int, interrupt_at: int, atol: float, rtol: float):
    """The continuous and the interrupted run (at once), checked; and whether they agree up to the interruption.

    Returns:
        ``(continuous, interrupted, continuous trajectory, interrupted trajectory, determinism)``.

    Raises:
        SourceError: a run failed or recorded other updates than ``1..n``.
    """
    f_cont, f_int = runs.submit("continuous", steps, None), runs.submit("interrupted", interrupt_at, None)
    cont, intr = f_cont.result(), f_int.result()
    for rec in (cont, intr):
        require_ok(rec)
    cont_traj, int_traj = load_trajectory(cont.output), load_trajectory(intr.output)
    for rec, traj, n in ((cont, cont_traj, steps), (intr, int_traj, interrupt_at)):
        got = [u["step"] for u in traj["updates"]]
        if got != list(range(1, n + 1)):
            raise SourceError(f"run '{rec.name}' recorded updates {span(got)}, expected 1..{n} "
                              "(does the script run {steps} updates and call Trajectory.record with step=?)",
                              where=str(rec.output / TRAJECTORY_FILE))
    det = compare_trajectories(cont_traj["updates"][:interrupt_at], int_traj["updates"], atol=atol, rtol=rtol)
    # [issue 27] the runs' own data ids (a label map from a set under PYTHONHASHSEED=random): named, not just
    # "update 1 (loss)"
    ids = data_ids_differences(cont_traj.get("data_ids"), int_traj.get("data_ids"), "continuous", "interrupted")
    determinism = {"matched": det["first_divergence"] is None and not det["structure"] and not ids,
                   "first_divergence": det["first_divergence"]}
    if ids is not None:
        determinism["data_ids"] = {"same": not ids, "differences": ids}
    return cont, intr, cont_traj, int_traj, determinism


def _archive_round_trip(loop: ArchiveLoop, intr: RunRecord, interrupt_at: int, resume_dir: Path,
                        ids: _DataIds | None = None, name: str = "restored.pt") -> dict:
    """Pack the interruption checkpoint, verify it deeply, restore it, and check it comes back exactly.

    Returns:
        ``{"facts", "archive", "restored" (the .pt path), "archived_state"}``.

    Raises:
        IntegrityError: the archive did not give the checkpoint back exactly, or failed verification.
    """
    int_ckpt = load_checkpoint(intr.output / CHECKPOINT_FILE)
    facts = interruption_facts(int_ckpt, interrupt_at)
    step = facts["step"] if facts["step"] is not None else interrupt_at
    archive = loop.store(intr.output / CHECKPOINT_FILE, step=step,
                         data_ids=ids.archived if ids is not None else None)
    if ids is not None and ids.resuming is not None:
        check = loop.check_data_ids(ids.resuming, allow_change=ids.allow_change)
        ids.checks.append(dict(check, at=interrupt_at))
        if check.get("warning"):
            ids.warnings.append(f"interruption at update {interrupt_at}: {check['warning']}")
    restored = loop.restore(resume_dir / name)
    archive["restored_to"] = str(restored)
    archived_state = loop.load()
    cmp_restored = TreeDiff(0.0, 0.0)
    cmp_restored.compare(int_ckpt, archived_state)
    archive["round_trip_exact"] = cmp_restored.total == 0
    if cmp_restored.total:
        d = cmp_restored.diffs[0]
        raise IntegrityError(f"the archive did not give back the interruption checkpoint exactly: "
                             f"{d['field']} ({d['kind']}: {short_value(d['expected'])} vs {short_value(d['got'])})",
                             where=archive["repository"])
    return {"facts": facts, "archive": archive, "restored": restored, "archived_state": archived_state}


@dataclasses.dataclass
class _Baseline:
    """What every control run is compared with."""

    traj: dict
    state: Any
    prefix: list[dict]
    restored: Path
    updates: int
    interrupt_at: int
    atol: float
    rtol: float


def _run_controls(runs: _Runs, base: _Baseline, archived_state, chosen: list[str], scripted: list[list[str]],
                  no_effect: set[str], resume_dir: Path, say: Event) -> list[dict]:
    """Run the negative controls (tool-made ones from a perturbed copy of the archived state, script-side
    ones with their extra arguments) and judge each; entries in the order the controls were asked for."""
    entries: list[dict] = []
    jobs_list = []
    previous_lr = base.prefix[-1]["lr"] if base.prefix else None
    total = base.interrupt_at + base.updates
    for name in chosen:
        label = CONTROL_LABELS[name]
        try:
            new_state, pert = perturb(archived_state, name, previous_lr=previous_lr)
        except CannotCheck as exc:  # no type-preserving perturbation: nothing to run, nothing shown
            entries.append(_could_not_check(name, "tool", f"could not check control {name}: {exc}"))
            continue
        if not pert.applied:
            entries.append(control_verdict(None, name=name, kind="tool", label=label,
                                           expected_no_effect=name in no_effect, applied=False, note=pert.note))
            continue
        import torch

        path = resume_dir / f"control-{name}.pt"
        torch.save(new_state, path)
        jobs_list.append((name, "tool", label, pert, path, ()))
    for args in scripted:
        name = script_control_name(args)
        jobs_list.append((name, "script", f"the script-side control {' '.join(args)!r}", None, base.restored, args))
    if jobs_list:
        say(f"running {len(jobs_list)} negative control(s): " + ", ".join(j[0] for j in jobs_list))
    futures = [(j, runs.submit(run_name(j[0]), base.updates, j[4], j[5], total)) for j in jobs_list]
    for (name, ckind, label, pert, path, _), fut in futures:
        e = _judge_control(fut.result(), base, name=name, kind=ckind, label=label,
                           expected_no_effect=name in no_effect)
        if pert is not None:
            e["changed"] = pert.changed[:MAX_LISTED]
            if path != base.restored:
                path.unlink(missing_ok=True)
        entries.append(e)
    order = {n: i for i, n in enumerate(list(chosen) + [script_control_name(a) for a in scripted])}
    entries.sort(key=lambda e: order.get(e["name"], 99))
    return entries


def _judge_control(rec: RunRecord, base: _Baseline, *, name: str, kind: str, label: str,
                   expected_no_effect: bool) -> dict:
    """The report entry of one control run. A run that fails (non-zero exit, no checkpoint or trajectory)
    tested nothing: the control *could not check* (never "diverged"); a timeout stops the check."""
    if rec.timed_out:
        raise SourceError(f"control run '{rec.name}' timed out after {rec.seconds:.0f} s")
    crashed = rec if (rec.exit_code != 0 or not (rec.output / CHECKPOINT_FILE).is_file()
                      or not (rec.output / TRAJECTORY_FILE).is_file()) else None
    cmp = None
    if crashed is None:
        traj = load_trajectory(rec.output)
        why = _wrong_update_count(rec, traj, base.updates, base.interrupt_at)
        if why:  # a run cut short "diverges" from the continuous one, but shows nothing about the resume
            return _could_not_check(name, kind, f"could not check control {name}: {why}")
        cmp = compare_runs(base.traj, traj, base.state,
                           load_checkpoint(rec.output / CHECKPOINT_FILE), interrupt_at=base.interrupt_at,
                           atol=base.atol, rtol=base.rtol, prefix=base.prefix, name=name, training_only=True)
    e = control_verdict(cmp, name=name, kind=kind, label=label, expected_no_effect=expected_no_effect,
                        crashed=crashed)
    if cmp is not None:
        e["comparison"] = compact(cmp)
    return e


def _could_not_check(name: str, kind: str, message: str) -> dict:
    """The entry of a control that tested nothing (its perturbation or its run failed): exit 2."""
    return {"name": name, "kind": kind, "diverged": False, "first_divergent_step": None, "field": None,
            "expected": None, "got": None, "status": "could-not-check", "ok": False,
            "message": message, "changed": []}


def _not_run(chosen: list[str], scripted: list[list[str]]) -> list[dict]:
    """Entries for the controls when the resume itself already diverged (they would show nothing)."""
    names = [(name, "tool") for name in chosen] + [(script_control_name(a), "script") for a in scripted]
    return [{"name": name, "kind": kind, "diverged": False, "first_divergent_step": None, "field": None,
             "expected": None, "got": None, "status": "not-run", "ok": False,
             "message": "not run: the resume itself already diverged", "changed": []} for name, kind in names]


def _segment_names(points: list[int]) -> list[str]:
    """The resumed runs' names, one per interruption (as :func:`check_resume` launches them)."""
    return [f"resumed-{k + 1}" for k in range(len(points) - 1)] + ["resumed"]


def _not_deterministic(determinism: dict, hash_seed: str | None) -> str:
    """The problem line of continuous and interrupted runs that differ before any resume, naming the data ids that
    differ (recorded with ``Trajectory(data_ids=)``), or the sample ids of the first batch that differs."""
    fd = determinism["first_divergence"] or {}
    ids = (determinism.get("data_ids") or {}).get("differences") or []
    if fd:
        text = (f"the script is not deterministic: the continuous and interrupted runs already differ at update "
                f"{fd.get('step')} ({fd.get('field')}) before any resume")
    else:
        text = "the script is not deterministic: the continuous and interrupted runs built different data ids"
    if ids:
        text += ("; their data ids differ: " + "; ".join(ids) + "; build them in a fixed order (sorted(...), not the "
                 "order of a set or of a dict built from one: string hashing, and so that order, changes between "
                 "processes unless PYTHONHASHSEED is fixed)")
    elif fd.get("field") == "sample_ids" and isinstance(fd.get("expected"), list) and isinstance(fd.get("got"), list):
        text += f": update {fd['step']} consumed " + ids_named(fd["expected"], fd["got"])
    elif "data_ids" not in determinism:
        text += ("; the same samples can mean different data in two processes (a label map or file list built from a "
                 "set): record the run's data ids with Trajectory(output, data_ids=...) to have them compared")
        if hash_seed == "random":
            text += " (PYTHONHASHSEED is 'random' here, so set and dict orders of strings change from run to run)"
    return text + "; seed every random stream from the config"


def _control_findings(entries: list[dict], ran: list[dict], positive_ok: bool, problems: list[str],
                      warnings: list[str]) -> None:
    """What the negative controls add to the problems (no effect, could not check, none asked for or none could
    run: nothing shows the check would see a broken resume) and to the warnings (a skipped control)."""
    for e in entries:
        if e["status"] in ("no-effect", "could-not-check"):
            problems.append(e["message"])
        elif e["status"] == "skipped":
            warnings.append(f"control {e['name']} {e['message']}")
    if positive_ok and not entries:
        problems.append("no negative control was asked for (--no-controls), so nothing shows that this check "
                        "would see a broken resume; run the default controls or give --script-control")
    elif positive_ok and not ran and not any(e["status"] == "could-not-check" for e in entries):
        why = "; ".join(f"{e['name']}: {e['message']}" for e in entries if e["status"] == "skipped")
        problems.append("no negative control could run, so nothing shows that this check would see a broken "
                        f"resume ({why})")


def _cursor_warnings(interruptions: Sequence[dict]) -> list[str]:
    """Each interruption whose ``data.cursor`` is not where the continuous run was in the epoch."""
    return [f"interruption at update {it['at']}: data.cursor {it['cursor']}, but the continuous run had consumed "
            f"{it['expected_cursor']} samples of epoch {it.get('epoch')} there (a cursor counted since the last "
            f"resume rather than from the start of the epoch replays data)"
            for it in interruptions if it.get("cursor") is not None and it.get("expected_cursor") is not None
            and it["cursor"] != it["expected_cursor"]]


def _verdict(determinism: dict, positive: dict, positive_ok: bool, entries: list[dict], facts: dict,
             interrupt_at: int, interruptions: list[dict] = (), resumed_ids: list = (),
             hash_seed: str | None = None) -> dict:
    """``all_ok``, ``negative_detected``, and the report's ``problems`` and ``warnings``.

    ``resumed_ids``: ``(run name, data_ids_differences against the continuous run)`` per resumed run."""
    ran = [e for e in entries if e["status"] not in ("skipped", "not-run", "could-not-check")]
    relevant = [e for e in ran if e["status"] != "no-effect-expected"]
    problems: list[str] = []
    warnings: list[str] = []
    if not determinism["matched"]:
        problems.append(_not_deterministic(determinism, hash_seed))
    for name, lines in resumed_ids:
        if lines:
            problems.append(f"the {name} run built other data ids than the continuous run: " + "; ".join(lines)
                            + "; the resumed process means other data by the same sample ids")
    if not positive["matched"]:
        problems.append("the resumed run does not match the continuous run: " + describe(positive))
    _control_findings(entries, ran, positive_ok, problems, warnings)
    if facts["step"] is not None and facts["step"] != interrupt_at:
        warnings.append(f"the interruption checkpoint says progress.step {facts['step']}, expected {interrupt_at}")
    warnings.extend(_cursor_warnings(interruptions))
    if any(e["status"] == "could-not-check" for e in entries):
        relevant = []
    controls_ok = positive_ok and all(e["ok"] for e in entries)
    return {"all_ok": positive_ok and controls_ok and not problems,
            "negative_detected": bool(relevant) and all(e["diverged"] for e in relevant),
            "problems": problems, "warnings": warnings}


__all__ = ["Event", "check_resume", "REPORT_FILE", "write_report"]
