"""Faults survived, measured: ``ckpt-archive pack`` / ``prune`` / ``forget`` / ``gc`` run in subprocesses
with ``CKPT_ARCHIVE_INJECT=<point>=kill|enospc|erofs`` at every lifecycle point, then the repository is
checked:

* every generation that was usable before is still usable and verifies (deep), except one that a
  prune/forget/gc was removing, which is either untouched (usable, verifies), ``partial`` or (a fault
  in the shared-object sweep, after the removal) gone, never damaged;
* no generation is listed as usable that does not verify; nothing is ``damaged``;
* the next ``pack`` succeeds (and reports leftovers), ``gc`` clears them (after gc no shared object is
  left that no manifest references, and no object write's temporary file), and the interrupted
  prune/forget completes when run again.

Sharing is live in every case (format 3): each state has a frozen tensor above ``share_min_bytes``
shared by every generation, and one of its own, so every pack creates an object (``object-write``,
``object-commit``) and references others, and every removal frees objects (``object-delete``) while
others stay referenced.

Plus two writers at once: one waits or fails with LockError (exit 2); never both write the same
generation. The number of injection points tried and survived is printed in the terminal summary
(see ``tests/conftest.py``).

Speed: tiny states; all injection subprocesses of the module are started together by one module
fixture (a few at a time), so the suite costs a few subprocess start-ups per core.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import ckpt_archive
from ckpt_archive.ops.forget import forget as forget_generation
from ckpt_archive.ops.gc import gc as collect_garbage
from ckpt_archive.ops.prune import prune as run_prune
from ckpt_archive.retention.policy import RetentionPolicy
from ckpt_archive.repo.repository import Repository

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

PACK_POINTS = ["claim", "member-write", "object-write", "object-commit", "after-members", "seal-write", "after-seal",
               "after-verify", "after-trial-reload", "publish", "after-publish"]
PUBLISHED_BY = {"after-publish", "retention"}  # points reached after the marker was written
PRUNE_POINTS = ["prune-before-marker-removal", "prune-after-marker-removal", "prune-mid-delete"]
DELETE_POINTS = PRUNE_POINTS + ["object-delete"]  # object-delete: in the sweep, after the generations went
ACTIONS = ["kill", "enospc", "erofs"]
BASE_GENERATIONS = 3  # usable generations in the repository before each injection

# (command, point, action): "pack" packs a 4th generation; "pack-retention" packs it with
# --keep-last 2 (retention removes 1 and 2, the fault fires while removing 1, or in the one sweep after
# both); "prune" prunes with --keep-last 1 (removes 1 and 2; likewise); "forget" forgets 1; "gc" collects
# a partial generation 4 (sealed, never published, referencing shared objects and one of its own).
CASES = ([("pack", p, a) for p in PACK_POINTS for a in ACTIONS]
         + [("pack-retention", p, a) for p in ["retention"] + DELETE_POINTS for a in ACTIONS]
         + [("prune", p, a) for p in DELETE_POINTS for a in ACTIONS]
         + [("forget", p, a) for p in DELETE_POINTS for a in ACTIONS]
         + [("gc", p, a) for p in DELETE_POINTS for a in ACTIONS])
REMOVES = {"pack-retention": [1, 2], "prune": [1, 2], "forget": [1]}  # in removal order ("gc": the partial 4)
WORKERS = max(2, min(4, (os.cpu_count() or 2)))
TIMEOUT = 180


SHARED_ELEMS = 280_000  # float32: 1.12 MB raw, above the default share_min_bytes (1 MiB)
FROZEN = torch.randn(SHARED_ELEMS, generator=torch.Generator().manual_seed(12345))


def state(i: int) -> dict:
    # two small tensors so that the point inside a member write ("member-write", after the 2nd piece) is
    # reached; "frozen" is the same in every generation (one shared object), "head" new in each (an object
    # each pack creates and each removal frees)
    g = torch.Generator().manual_seed(i)
    return {"model": {"a": torch.randn(64, generator=g), "b": torch.randn(32, generator=g),
                      "frozen": FROZEN.clone(), "head": torch.randn(SHARED_ELEMS, generator=g)},
            "optimizer": {"lr": 0.01 * i}, "step": 100 * i}


def object_refs(repo: Path) -> dict[int, set[str]]:
    """``{generation: {object key}}`` from every readable manifest."""
    from ckpt_archive.format.objects import object_key, refs

    return {g.number: {object_key(fp) for fp in refs(g.manifest)} for g in Repository.open(repo).generations()
            if g.manifest is not None}


def object_files(repo: Path) -> list[str]:
    root = repo / "objects"
    return sorted(str(p.relative_to(repo)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def cli_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "ckpt_archive", *map(str, args)]


def env_with(inject: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CKPT_ARCHIVE_INJECT"}
    if inject:
        env["CKPT_ARCHIVE_INJECT"] = inject
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault-template")
    repo = root / "repo"
    for i in range(1, BASE_GENERATIONS + 1):
        ckpt_archive.pack(state(i), repo, annotations=ckpt_archive.Annotations(metrics={"val_loss": 1.0 / i}))
    refs = object_refs(repo)
    assert len(refs[1]) == 2 and all(len(refs[1] & refs[n]) == 1 for n in range(2, BASE_GENERATIONS + 1)), \
        f"sharing is not live in the template: {refs}"
    src = root / "next.pt"
    torch.save(state(BASE_GENERATIONS + 1), src)
    # the gc cases' repository: generation 4 sealed, never published (a pack that failed after the seal)
    gc_repo = root / "gc-repo"
    shutil.copytree(repo, gc_repo)
    for n in range(1, BASE_GENERATIONS + 1):  # usable here, so the partial one references their objects
        assert ckpt_archive.verify(gc_repo, n, options=ckpt_archive.VerifyOptions(deep=True)).marked_usable
    saved = os.environ.get("CKPT_ARCHIVE_INJECT")
    os.environ["CKPT_ARCHIVE_INJECT"] = "after-seal=raise"
    try:
        with pytest.raises(RuntimeError, match="injected failure at after-seal"):
            ckpt_archive.pack(state(BASE_GENERATIONS + 1), gc_repo)
    finally:
        if saved is None:
            os.environ.pop("CKPT_ARCHIVE_INJECT", None)
        else:
            os.environ["CKPT_ARCHIVE_INJECT"] = saved
    partial = Repository.open(gc_repo).generation(BASE_GENERATIONS + 1)
    assert partial.status == "partial" and len(object_refs(gc_repo)[partial.number]) == 2
    return repo, src, gc_repo


def case_id(case) -> str:
    return f"{case[0]}:{case[1]}={case[2]}"


def case_args(case, src: Path, repo: Path) -> list:
    command = case[0]
    if command == "pack":
        return ["pack", src, "--repo", repo]
    if command == "pack-retention":
        return ["pack", src, "--repo", repo, "--keep-last", 2, "--json"]
    if command == "forget":
        return ["forget", f"{repo}@1"]
    if command == "gc":
        return ["gc", repo]
    return ["prune", repo, "--keep-last", 1]


def prepare(template, workdir: Path, command: str = "pack") -> tuple[Path, list[int]]:
    """A fresh copy of the template repository (for ``gc``: with a partial generation 4), made usable at
    its new place the documented way (a copy is ``copied`` until ``verify --deep`` there rewrites the marker)."""
    repo = workdir / "repo"
    shutil.copytree(template[2] if command == "gc" else template[0], repo)
    for n in range(1, BASE_GENERATIONS + 1):
        assert ckpt_archive.verify(repo, n, options=ckpt_archive.VerifyOptions(deep=True)).marked_usable
    before = [g.number for g in Repository.open(repo).usable()]
    assert before == list(range(1, BASE_GENERATIONS + 1))
    return repo, before


def run_in_subprocess(case, template, repo: Path) -> tuple[int | None, str, str]:
    """SIGKILL needs a process of its own."""
    try:
        proc = subprocess.run(cli_cmd(*case_args(case, template[1], repo)),
                              env=env_with(f"{case[1]}={case[2]}"), capture_output=True, text=True, timeout=TIMEOUT)
        return proc.returncode, proc.stderr, proc.stdout
    except subprocess.TimeoutExpired:
        return None, "timed out", ""


def run_in_process(case, template, repo: Path) -> tuple[int, str, str]:
    """ENOSPC / EROFS are exceptions: the same CLI code path runs in-process (Typer's CliRunner)."""
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    saved = os.environ.get("CKPT_ARCHIVE_INJECT")
    os.environ["CKPT_ARCHIVE_INJECT"] = f"{case[1]}={case[2]}"
    try:
        res = CliRunner().invoke(app, [str(a) for a in case_args(case, template[1], repo)])
    finally:
        if saved is None:
            os.environ.pop("CKPT_ARCHIVE_INJECT", None)
        else:
            os.environ["CKPT_ARCHIVE_INJECT"] = saved
    err = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        err += f"\nTraceback: {res.exception!r}"
    return res.exit_code, err, res.stdout


@pytest.fixture(scope="module")
def fault_runs(template, tmp_path_factory):
    """Run every case: the kill cases as subprocesses in the background, a few at a time, while the
    in-process cases run one by one here."""
    base = tmp_path_factory.mktemp("fault-cases")
    prepared = {}
    for i, case in enumerate(CASES):
        d = base / f"{i:02d}"
        d.mkdir()
        prepared[case] = prepare(template, d, case[0])
    runs = {}
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        futures = {case: pool.submit(run_in_subprocess, case, template, prepared[case][0])
                   for case in CASES if case[2] == "kill"}
        for case in CASES:
            if case[2] != "kill":
                runs[case] = run_in_process(case, template, prepared[case][0])
        for case, fut in futures.items():
            runs[case] = fut.result()
    return {case: {"repo": prepared[case][0], "before": prepared[case][1], "rc": runs[case][0],
                   "stderr": runs[case][1], "stdout": runs[case][2]} for case in CASES}


def assert_fault_fired(case, run) -> None:
    """The injected fault really happened at that point (else the case would prove nothing)."""
    command, point, action = case
    # with --json the report (warnings, or the error) is the JSON object on stdout, and stderr stays empty
    rc, err = run["rc"], run["stderr"] + run["stdout"]
    assert rc is not None, f"{case_id(case)}: the command hung"
    if action == "kill":
        assert rc == -signal.SIGKILL, f"{case_id(case)}: expected SIGKILL at {point}, got rc={rc}: {err[-500:]}"
        return
    needle = "space" if action == "enospc" else "ead-only"
    assert "Traceback" not in err
    if point in PUBLISHED_BY:
        # the marker is written: the new generation is usable, so pack succeeds and says what stopped
        assert rc == 0, f"{case_id(case)}: rc={rc}: {err[-500:]}"
        assert "is usable, but retention did not run to completion" in err and needle in err, err[-500:]
    elif command == "pack-retention" and point != "retention":
        # the new generation is usable before retention runs: pack succeeds, retention says why it stopped
        assert rc == 0, f"{case_id(case)}: rc={rc}: {err[-500:]}"
        warnings = json.loads(run["stdout"])["retention"]["warnings"]
        assert any("retention stopped" in w and needle in w for w in warnings), warnings
    else:
        assert needle in err, f"{case_id(case)}: the {action} error is not reported: {err[-500:]}"
        assert rc == 2, f"{case_id(case)}: expected exit 2, got {rc}: {err[-500:]}"


def check_repository(case, run) -> None:
    command, point, action = case
    repo = run["repo"]
    before = run["before"]
    r = Repository.open(repo)
    gens = {g.number: g for g in r.generations()}
    statuses = {n: g.status for n, g in gens.items()}
    assert set(statuses.values()) <= {"usable", "partial"}, f"{case_id(case)}: {statuses}"
    # every generation listed as usable verifies, deeply
    for n, g in gens.items():
        if g.status == "usable":
            report = ckpt_archive.verify(repo, n, options=ckpt_archive.VerifyOptions(deep=True))
            assert report.ok, f"{case_id(case)}: generation {n} is listed usable but fails: {report.problems}"
    new = max(before) + 1
    # the generations the interrupted command removes, in order; a deletion point fires while removing the
    # first (then it is usable, partial or, for gc's partial victim, partial) or, object-delete, in the
    # sweep after all of them went; every other generation usable before, and a generation published
    # before the fault, stays usable
    removing = REMOVES.get(command, [])
    if command == "gc":
        removing = [new]
    being_removed = {removing[0]} if point in PRUNE_POINTS else set()
    gone = set(removing) if point == "object-delete" else set()
    must_be_usable = set(before) - being_removed - gone
    if command == "pack-retention" or point in PUBLISHED_BY:
        must_be_usable.add(new)
    for n in sorted(must_be_usable):
        assert statuses.get(n) == "usable", f"{case_id(case)}: #{n} must be usable, is {statuses.get(n)}"
    for n in being_removed:
        assert statuses.get(n) in ("usable", "partial"), f"{case_id(case)}: #{n} is {statuses.get(n)}"
    for n in gone:
        assert n not in statuses, f"{case_id(case)}: #{n} was removed before the sweep, but is {statuses[n]}"
    if (command.startswith("pack") or command == "gc") and new not in must_be_usable | gone:
        assert statuses.get(new) != "usable", f"{case_id(case)}: an interrupted generation is listed usable"
    victim = removing[0] if removing else None
    if point == "prune-before-marker-removal":
        assert statuses.get(victim) == ("usable" if victim in before else "partial")
    if point in ("prune-after-marker-removal", "prune-mid-delete"):
        assert statuses.get(victim) == "partial", f"{case_id(case)}: half-removed #{victim} must read partial"
    # no object any remaining manifest references was deleted (whatever the generation's status)
    missing = sorted({k for refs in object_refs(repo).values() for k in refs if not (repo / k).is_file()})
    assert not missing, f"{case_id(case)}: objects a remaining manifest references were deleted: {missing}"


def check_recovery(case, run) -> None:
    """The next pack succeeds and reports leftovers; gc clears them; the interrupted prune completes."""
    command, point, action = case
    repo = run["repo"]
    partial = [g.number for g in Repository.open(repo).generations() if g.status == "partial"]
    res = ckpt_archive.pack(state(99), repo)
    assert res.status == "usable"
    assert ckpt_archive.verify(repo, res.generation, options=ckpt_archive.VerifyOptions(deep=True)).ok
    if partial:
        assert res.leftovers, f"{case_id(case)}: pack did not report leftovers {partial}"
    removed = [x["generation"] for x in collect_garbage(str(repo)).removed]
    assert sorted(removed) == sorted(partial)
    assert_no_unreferenced_objects(case, repo)
    r = Repository.open(repo)
    assert all(g.status == "usable" for g in r.generations())
    loaded = ckpt_archive.load(repo)
    assert loaded["step"] == 9900 and torch.equal(loaded["model"]["frozen"], FROZEN)
    if command == "prune":  # the interrupted prune, run again, completes
        run_prune(str(repo), RetentionPolicy(keep_last=1), dry_run=False, wait=0)
        assert [g.number for g in Repository.open(repo).usable()] == [res.generation]
    if command == "forget":  # the interrupted forget, run again, completes (or #1 is gone already)
        if 1 in {g.number for g in Repository.open(repo).generations()}:
            forget_generation(str(repo), 1)
        assert 1 not in {g.number for g in Repository.open(repo).generations()}
    assert_no_unreferenced_objects(case, repo)
    for g in Repository.open(repo).usable():
        assert ckpt_archive.verify(repo, g.number, options=ckpt_archive.VerifyOptions(deep=True)).ok, \
            f"{case_id(case)}: #{g.number} after recovery"


def assert_no_unreferenced_objects(case, repo: Path) -> None:
    """After gc (and any completed removal): every object file is referenced by a manifest, none half-written."""
    referenced = {k for refs in object_refs(repo).values() for k in refs}
    files = object_files(repo)
    assert set(files) == referenced, (f"{case_id(case)}: unreferenced or half-written objects left: "
                                      f"{sorted(set(files) - referenced)}; missing: {sorted(referenced - set(files))}")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_repository_survives_fault_at_every_lifecycle_point(case, fault_runs, fault_tally):
    fault_tally["tried"] += 1
    name = case_id(case)
    fault_tally["failed"].append(name)
    run = fault_runs[case]
    assert_fault_fired(case, run)
    check_repository(case, run)
    check_recovery(case, run)
    fault_tally["failed"].remove(name)
    fault_tally["survived"] += 1


# ---------------------------------------------------------------------------------------------- two writers
def test_second_pack_fails_with_lock_error_exit_2_and_writes_nothing(template, tmp_path):
    repo, _ = prepare(template, tmp_path)
    before = sorted(os.listdir(repo / "generations"))
    with Repository.open(repo).lock():
        proc = subprocess.run(cli_cmd("pack", template[1], "--repo", repo, "--json"), env=env_with(None),
                              capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"] == "LockError"
    assert "locked by another writer" in json.loads(proc.stdout)["reason"] and proc.stderr == ""
    assert sorted(os.listdir(repo / "generations")) == before


def test_second_pack_with_wait_queues_behind_the_first(template, tmp_path):
    repo, _ = prepare(template, tmp_path)
    lock = Repository.open(repo).lock()
    lock.__enter__()
    try:
        proc = subprocess.Popen(cli_cmd("pack", template[1], "--repo", repo, "--wait", 60, "--json"),
                                env=env_with(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        assert proc.poll() is None, "the waiting writer did not wait for the lock"
    finally:
        lock.__exit__(None, None, None)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert json.loads(out)["generation"] == BASE_GENERATIONS + 1


@pytest.mark.parametrize("wait", [0, 60])
def test_two_concurrent_packs_never_write_the_same_generation(template, tmp_path, wait):
    repo, _ = prepare(template, tmp_path)
    procs = [subprocess.Popen(cli_cmd("pack", template[1], "--repo", repo, "--wait", wait, "--json"),
                              env=env_with(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=TIMEOUT), *p.communicate()) for p in procs]
    gens = []
    for rc, out, err in results:
        data = json.loads(out)
        if rc == 0:
            gens.append(data["generation"])
        else:
            assert rc == 2 and data["error"] == "LockError", err
    assert gens and len(gens) == len(set(gens)), f"two writers wrote the same generation: {gens}"
    if wait:
        assert len(gens) == 2
    r = Repository.open(repo)
    assert [g.status for g in r.generations()] == ["usable"] * (BASE_GENERATIONS + len(gens))
    for n in gens:
        assert ckpt_archive.verify(repo, n, options=ckpt_archive.VerifyOptions(deep=True)).ok


def test_two_concurrent_backups_of_one_source_store_it_once(template, tmp_path):
    repo, _ = prepare(template, tmp_path)
    src = tmp_path / "run" / "last.pt"
    src.parent.mkdir()
    shutil.copy(template[1], src)
    old = time.time() - 60
    os.utime(src, (old, old))
    procs = [subprocess.Popen(cli_cmd("backup", src, "--repo", repo, "--settle", 0, "--wait", 60, "--json"),
                              env=env_with(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=TIMEOUT), *p.communicate()) for p in procs]
    actions = sorted(json.loads(out)["action"] for rc, out, err in results)
    assert all(rc == 0 for rc, _, _ in results), [err for _, _, err in results]
    assert actions == ["packed", "unchanged"], actions
    usable = Repository.open(repo).usable()
    assert len(usable) == BASE_GENERATIONS + 1
    assert all(g.status == "usable" for g in Repository.open(repo).generations())
