"""The end-to-end resume proof on the demo's training project (``ckpt-archive demo``)."""
from __future__ import annotations

import math
import os
import sys
from typing import Callable

from ckpt_archive.demo import BATCH, INTERRUPT_AT, ROWS, STEPS

#: The demo's command template: the same contract as any ``check-resume`` script.
COMMAND = [sys.executable, "-m", "ckpt_archive.demo.train", "--steps", "{steps}", "--output", "{output}",
           "{resume:--resume-from {}}"]
#: The seed protocol's script-side negative control: resume with the RNG restore omitted.
SCRIPT_CONTROL = "--omit-rng-restore"
#: LR for the update after update 10: 0.03 * 0.5 ** (10 // 3).
NEXT_LR = 0.03 * 0.5 ** (STEPS // 3)


def demo_facts(report: dict) -> list[dict]:
    """The known facts the demo must show, each with what was observed and whether it holds."""
    it = report["interruption"]
    cont = report["data"]["continuous"]
    line = report["data"]["resumed_line"]
    nl = report["next_lr_after_final_step"]
    facts = [
        {"fact": f"the data cursor at the interruption is {INTERRUPT_AT * BATCH} of {ROWS} (mid-epoch)",
         "observed": f"{it['cursor']} of {it['samples_per_epoch']}, mid_epoch={it['mid_epoch']}",
         "ok": it["cursor"] == INTERRUPT_AT * BATCH and it["samples_per_epoch"] == ROWS and it["mid_epoch"] is True},
        {"fact": f"{STEPS} updates consume {STEPS * BATCH} rows across a new permutation",
         "observed": f"continuous {cont['samples_consumed']} rows, epochs {cont['epochs']}; interrupted+resumed "
                     f"{line['samples_consumed']} rows, epochs {line['epochs']}",
         "ok": cont["samples_consumed"] == line["samples_consumed"] == STEPS * BATCH
               and cont["epochs"] == line["epochs"] == [0, 1]},
        {"fact": f"the LR for the update after update {STEPS} is {NEXT_LR} in both runs",
         "observed": f"continuous {nl['continuous']}, resumed {nl['resumed']}",
         "ok": nl["continuous"] is not None and nl["resumed"] is not None
               and all(math.isclose(x, NEXT_LR, rel_tol=0, abs_tol=1e-15) for x in nl["continuous"] + nl["resumed"])},
        {"fact": "the full resume matches exactly (max parameter deviation 0)",
         "observed": f"max_param_abs_diff={report['max_param_abs_diff']}, matched={report['positive']}",
         "ok": report["max_param_abs_diff"] == 0.0 and report["positive"]},
        {"fact": "the negative control (RNG restore omitted) diverges",
         "observed": "; ".join(f"{e['name']}: {e['status']}" for e in report["negative_controls"]
                               if e["kind"] == "script"),
         "ok": any(e["kind"] == "script" and e["diverged"] for e in report["negative_controls"])},
    ]
    return facts


def run_demo(output: str | os.PathLike | None = None, *, jobs: int | None = None,
             on_event: Callable[[str], None] | None = None) -> dict:
    """Run the demo's resume proof and write ``verification.json`` (with a ``demo_facts`` section).

    Runs, each in a fresh process: 10 updates continuous; 5 updates, then pack + deep verify + restore
    through a repository in ``output/archive``; 5 more from the restored checkpoint; the same resume with
    the RNG restore omitted; and the tool-made negative controls of :func:`ckpt_archive.resume.check.check_resume`.

    Args:
        output: a new or empty folder; default ``./ckpt-archive-demo-<UTC timestamp>``.
        jobs: runs at once (default: up to 4, by CPU count).

    Returns:
        the report (``all_checks_passed`` is the verdict: the positive matches, every negative control
        diverges, and every known fact holds).

    Raises:
        OutputExists: ``output`` exists and is not empty (an earlier proof is never overwritten).
        SourceError: a run failed; IntegrityError: the archived checkpoint failed verification.
    """
    from ckpt_archive.resume.check import REPORT_FILE, check_resume, write_report
    from ckpt_archive.resume.report import record_last_check

    if jobs is None:
        jobs = max(1, min(4, os.cpu_count() or 1))
    report = check_resume(COMMAND, steps=STEPS, interrupt_at=INTERRUPT_AT, output=output, atol=1e-12, rtol=0.0,
                          script_controls=[SCRIPT_CONTROL], jobs=jobs, on_event=on_event, kind="demo")
    facts = demo_facts(report)
    report["demo_facts"] = facts
    for f in facts:
        if not f["ok"]:
            report["problems"].append(f"demo fact does not hold: {f['fact']} (observed: {f['observed']})")
    report["all_checks_passed"] = bool(report["all_checks_passed"] and all(f["ok"] for f in facts))
    write_report(report, __import__("pathlib").Path(report["output"]) / REPORT_FILE)
    record_last_check(report["archive"]["repository"], report)  # the verdict with the demo facts
    return report
