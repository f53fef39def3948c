"""``ckpt-archive prune REPO [policy flags] [--dry-run]``: apply a retention policy.

The policy flags are defined here once and reused by ``backup`` and ``pack``; :func:`policy_from_flags`
builds the policy. The prune itself is :func:`ckpt_archive.ops.prune.prune`; this module parses options
and renders the decision (:func:`decision_table`).
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, Output, command, exit_codes_help, exit_code_for, human_bytes, seconds_callback, KEY_FILE_OPTION, open_cli_repo)

KEEP_LAST = typer.Option(None, "--keep-last", min=0, metavar="N", help="Keep the N newest usable generations.",
                         rich_help_panel="Retention policy")
KEEP_HOURLY = typer.Option(None, "--keep-hourly", min=0, metavar="N", help="Keep the newest generation of each of the last N "
                           "hours (UTC) that have one.", rich_help_panel="Retention policy")
KEEP_DAILY = typer.Option(None, "--keep-daily", min=0, metavar="N", help="Same for the last N days (UTC).",
                          rich_help_panel="Retention policy")
KEEP_WEEKLY = typer.Option(None, "--keep-weekly", min=0, metavar="N", help="Same for the last N ISO weeks (UTC).",
                           rich_help_panel="Retention policy")
KEEP_MONTHLY = typer.Option(None, "--keep-monthly", min=0, metavar="N", help="Same for the last N months (UTC).",
                            rich_help_panel="Retention policy")
KEEP_WITHIN = typer.Option(None, "--keep-within", metavar="DURATION", help="Keep every generation created within "
                           "DURATION of the newest usable one, e.g. 2d3h, 1w, 1y6m (y, m=months, w, d, h).",
                           rich_help_panel="Retention policy")
KEEP_TAG = typer.Option(None, "--keep-tag", metavar="TAG", help="Keep every generation with this tag (repeatable; "
                        "'a,b' needs both).", rich_help_panel="Retention policy")
KEEP_BEST = typer.Option(None, "--keep-best", min=0, metavar="N", help="Keep the N best generations by --best-by.",
                         rich_help_panel="Retention policy")
BEST_BY = typer.Option(None, "--best-by", metavar="METRIC:min|max", help="Metric from the manifest, e.g. "
                       "val_loss:min. A generation without it (or NaN) is never best.",
                       rich_help_panel="Retention policy")
WAIT = typer.Option(0.0, "--wait", metavar="SECONDS", callback=seconds_callback("--wait"), help="Wait up to SECONDS for another writer's lock "
                    "(default: fail at once with exit 2).")

POLICY_HELP = ("The newest usable generation is always kept; generations that are not usable are never counted "
               "and never removed here (gc removes leftovers); a policy that would keep none of the usable "
               "generations is refused. Never leaves nothing restorable: before removing anything, the kept "
               "generations are verified newest first (the size and sha256 of every stored chunk, members and "
               "shared objects) until one passes; if none passes, the newest generation the policy removes "
               "that does is kept as well (a warning names it); if no generation passes at all, nothing is "
               "removed and the prune exits 1 naming what failed. --dry-run makes the same check. Calendar "
               "buckets are in UTC.")


def policy_from_flags(keep_last: Optional[int], keep_hourly: Optional[int], keep_daily: Optional[int],
                      keep_weekly: Optional[int], keep_monthly: Optional[int], keep_within: Optional[str],
                      keep_tag: Optional[List[str]], keep_best: Optional[int], best_by: Optional[str]):
    """Return a :class:`~ckpt_archive.retention.policy.RetentionPolicy` from the flags, or ``None`` when none was given.

    Raises:
        UsageError: a malformed flag value (bad duration, bad --best-by, --keep-best without --best-by).
    """
    from ckpt_archive.retention.policy import RetentionPolicy

    given = [keep_last, keep_hourly, keep_daily, keep_weekly, keep_monthly, keep_within, keep_best, best_by]
    if all(v is None for v in given) and not keep_tag:
        return None
    return RetentionPolicy.from_flags(keep_last=keep_last, keep_hourly=keep_hourly, keep_daily=keep_daily,
                                      keep_weekly=keep_weekly, keep_monthly=keep_monthly, keep_within=keep_within,
                                      keep_tag=keep_tag, keep_best=keep_best, best_by=best_by)


def decision_table(decision, generations, title: str, check=None, width: int = 200):
    """A table of a retention decision fitted to ``width`` columns: generation, created, step, stored size,
    action, why (:func:`ckpt_archive.cli.tables.fit`; the reasons wrap in their column; on a narrow terminal
    the date loses its year, then the stored size goes).

    ``check`` (a :class:`~ckpt_archive.ops.prune.KeptCheck`) adds what the kept-generation check found
    to the "why" of each kept generation it read (or trusted).
    """
    from rich.text import Text

    from ckpt_archive.cli.tables import Col, fit

    cols = (Col("gen", "gen", justify="right"),
            Col("created", "created (UTC)", forms=(("created", lambda t: t), ("created", lambda t: t[5:]))),
            Col("step", "step", justify="right"), Col("stored", "stored", justify="right"), Col("action", "action"),
            Col("why", "why", kind="prose", min_width=14))
    by_number = {g.number: g for g in generations}
    styles = {"keep": "green", "remove": "red", "not usable": "yellow"}
    failed = dict(check.failed + check.rescue_failed) if check is not None else {}
    rows = []
    for number, action, reasons in decision.rows():
        if check is not None and number == check.verified:
            reasons = list(reasons) + ["verified at pack" if check.trusted else "verified (sizes + sha256)"]
        elif check is not None and number == check.rescued:
            action = "keep"  # the newest that verifies, kept although the policy removes it
            reasons = list(reasons) + ["KEPT: no kept generation verifies, this one does"]
        elif number in failed:
            where = sorted({line.split(": ", 1)[0] for line in failed[number]})
            reasons = list(reasons) + ["FAILS verify (" + ", ".join(where) + ")"]
        g = by_number.get(number)
        created = g.created.strftime("%Y-%m-%d %H:%M") if g is not None and g.created else "-"
        step = str(g.step) if g is not None and g.step is not None else "-"
        size = human_bytes(g.stored_bytes) if g is not None and g.stored_bytes is not None else "-"
        label = {"keep": "keep", "remove": "REMOVE", "not usable": "left for gc"}[action]
        rows.append([str(number), created, step, size, Text(label, style=styles[action]), "; ".join(reasons)])
    return fit(cols, rows, width, title=title, degrade=(("abbrev", "created"), ("abbrev", "created"),
                                                       ("drop", "stored")))


def register(app: typer.Typer) -> None:
    @app.command("prune", help="Apply a retention policy (restic's vocabulary) to a repository's generations. "
                 "Without policy flags, the repository's default policy (repository.json) is used; an empty "
                 "policy is refused. --dry-run prints what stays and what goes, and why, and deletes nothing. "
                 + POLICY_HELP
                 + exit_codes_help({0: "pruned (or, with --dry-run, the decision printed), also when nothing was to go",
                                    1: "refused: no generation verifies, kept or to be removed (each failure "
                                       "named); nothing was removed",
                                    2: "could not be carried out (empty or malformed policy, not a repository, "
                                       "lock held by another writer)"}))
    @command
    def prune_cmd(
        repo: str = typer.Argument(..., metavar="REPO", help="Repository path or URL."),
        keep_last: Optional[int] = KEEP_LAST, keep_hourly: Optional[int] = KEEP_HOURLY,
        keep_daily: Optional[int] = KEEP_DAILY, keep_weekly: Optional[int] = KEEP_WEEKLY,
        keep_monthly: Optional[int] = KEEP_MONTHLY, keep_within: Optional[str] = KEEP_WITHIN,
        keep_tag: Optional[List[str]] = KEEP_TAG, keep_best: Optional[int] = KEEP_BEST,
        best_by: Optional[str] = BEST_BY,
        dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Print the decision; delete nothing."),
        save_default: bool = typer.Option(False, "--save-default", help="Also store this policy as the "
                                          "repository's default (used by pack, backup and prune without flags)."),
        wait: float = WAIT,
        key_file: Optional[Path] = KEY_FILE_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.ops.prune import prune

        out = Output(json_output)
        policy = policy_from_flags(keep_last, keep_hourly, keep_daily, keep_weekly, keep_monthly, keep_within,
                                   keep_tag, keep_best, best_by)
        result = prune(open_cli_repo(repo, key_file=key_file), policy, dry_run=dry_run, wait=wait, save_default=save_default)
        decision, check = result.decision, result.check
        if not json_output:
            verb = "would remove" if dry_run else "removed"
            out.table(decision_table(decision, result.generations,
                                     f"{decision.policy.describe()} ({'dry run' if dry_run else 'prune'})",
                                     check=check, width=out.width))
            if not result.refused:
                out.say(f"check before removing: {check.describe()}")
        for w in result.warnings:
            out.warn(w)
        if not result.ok:
            code = exit_code_for(result)
            out.error(f"error: a prune would be refused: {result.refused}")
            out.json({"ok": False, **result.to_json(), "exit_code": code})
            raise typer.Exit(code)
        if not json_output:
            done = result.to_remove if dry_run else result.removed
            kept = len(decision.keep) + (check.rescued is not None)
            out.say(f"{verb} {len(done)} generation(s){': ' + ', '.join(map(str, sorted(done))) if done else ''}; "
                    f"kept {kept}; {len(decision.not_usable)} not usable left for gc")
            if result.objects is not None and not result.objects.kept and result.objects.describe(dry_run):
                out.say(f"shared objects: {result.objects.describe(dry_run)}")
            if result.saved_default:
                out.say(f"saved as the repository's default policy: {decision.policy.describe()}")
        out.json({"ok": True, **result.to_json()})


__all__ = ["KEEP_LAST", "KEEP_HOURLY", "KEEP_DAILY", "KEEP_WEEKLY", "KEEP_MONTHLY", "KEEP_WITHIN", "KEEP_TAG",
           "KEEP_BEST", "BEST_BY", "WAIT", "POLICY_HELP", "policy_from_flags", "decision_table", "register"]
