"""The recovery proof of an export: everything the next machine needs, as Markdown or JSON.

Split from :mod:`ckpt_archive.ops.export` (the copy) so that each stays readable. What the proof
carries (docs/export.md, "The recovery proof"):

* where: destination, **endpoint** (``--endpoint-url``, else ``AWS_ENDPOINT_URL_S3`` /
  ``AWS_ENDPOINT_URL`` as botocore reads them) and **region**, so its commands do not go to AWS when
  the bucket lives on MinIO or R2;
* how to get the tool there: the **exact install** of the code that wrote the proof (from a checkout:
  the README's command at that commit; from a package index: that version);
* what: per generation the archive id, the manifest's sha256 and every source file's sha256 (the
  **fingerprints**), the objects at DEST (members' files and the shared objects they reference) and what
  this run did with each (copied, present and not copied, replaced, kept), every check, and the
  **trial-reload record** (where, when, on which host, tensors and bytes decoded);
* the exact **verify and restore commands**.
"""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path


def endpoint_for(location: str, endpoint_url: str | None) -> str | None:
    """The S3 endpoint DEST was reached through: the explicit one, else the environment's (what botocore
    uses), else None (AWS itself). Only for remote locations."""
    if "://" not in location or location.startswith("file://"):
        return None
    return endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def region_for(location: str) -> str | None:
    """The region botocore would use (``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / the profile's), or None."""
    if "://" not in location or location.startswith("file://"):
        return None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        return region
    try:
        import botocore.session

        return botocore.session.Session().get_config_variable("region") or None
    except Exception:  # noqa: BLE001 - no botocore, or an unreadable profile: the proof just omits it
        return None


def env_prefix(endpoint: str | None, region: str | None = None) -> str:
    """``AWS_ENDPOINT_URL=... AWS_REGION=... `` for the commands of the proof (empty for AWS defaults)."""
    parts = []
    if endpoint:
        parts.append(f"AWS_ENDPOINT_URL={shlex.quote(endpoint)}")
    if region and endpoint:
        parts.append(f"AWS_REGION={shlex.quote(region)}")
    return " ".join(parts) + (" " if parts else "")


def key_args(encrypted: bool, signer: str | None) -> str:
    """What the commands of the proof add for an encrypted or signed destination: placeholders that name the files
    to bring (never a key: the proof is stored in the clear)."""
    args = " --key-file REPOSITORY.key" if encrypted else ""
    return args + (f" --trust SIGNER.pub  # signed by {signer}" if signer else "")


def restore_command(location: str, g, endpoint_url: str | None = None, region: str | None = None, *,
                    encrypted: bool = False) -> str:
    """The exact command that restores generation ``g`` from ``location`` on a new machine (with
    ``--key-file`` for an encrypted repository and ``--trust`` for a signed generation, as placeholders)."""
    source = (g.manifest or {}).get("source") or {}
    if source.get("layout") == "folder":
        out = Path(source.get("path") or "").name or f"checkpoint-step{g.step}"
    else:
        name = str((source.get("info") or {}).get("filename") or "")
        out = name if name.endswith((".pt", ".pth")) else "checkpoint.pt"
    spec = f"{location}@{g.number}"
    return (f"{env_prefix(endpoint_for(location, endpoint_url), region)}ckpt-archive restore {shlex.quote(spec)} "
            f"--output {shlex.quote(out)}{key_args(encrypted, getattr(g, 'signer', None))}")


def verify_command(location: str, number: int, endpoint_url: str | None = None, region: str | None = None, *,
                   encrypted: bool = False, signer: str | None = None) -> str:
    """The exact command that re-proves generation ``number`` at ``location``."""
    return (f"{env_prefix(endpoint_for(location, endpoint_url), region)}ckpt-archive verify "
            f"{shlex.quote(f'{location}@{number}')} --deep{key_args(encrypted, signer)}")


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def install_commands(remote: bool) -> list[str]:
    """How to install exactly the code that is running, on a new machine.

    From a checkout (the package lies in a git work tree with ``pyproject.toml``): clone that remote at
    that commit and install as the README does (``python -m pip install -c constraints.txt -e .``, with
    the ``s3`` extra for a remote destination). Otherwise: the installed version from the package index.

    Args:
        remote: the destination is an object store (the ``s3`` extra is needed).

    Returns:
        shell lines, in order.
    """
    import ckpt_archive

    extra = '".[s3]"' if remote else "."
    root = Path(ckpt_archive.__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / ".git").exists():
        commit = _git(root, "rev-parse", "HEAD")
        origin = _git(root, "config", "--get", "remote.origin.url")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
        lines = []
        if origin and commit:
            lines.append(f"git clone {shlex.quote(origin)} ckpt-archive && cd ckpt-archive && git checkout {commit}")
        elif commit:
            lines.append(f"# a checkout of ckpt-archive at commit {commit} (no remote recorded: copy that tree)")
        if dirty:
            lines.append("# note: the checkout that wrote this proof had uncommitted changes")
        lines.append(f"python -m pip install -c constraints.txt -e {extra}")
        return lines
    spec = f"ckpt-archive[s3]=={ckpt_archive.__version__}" if remote else f"ckpt-archive=={ckpt_archive.__version__}"
    return [f"python -m pip install {shlex.quote(spec)}"]


def fingerprints(manifest: dict, manifest_sha256: str | None) -> dict:
    """What identifies a generation's content: archive id, manifest sha256, and every source file's sha256."""
    source = manifest.get("source") or {}
    files = [{"path": f.get("relpath") or f.get("path") or "", "bytes": f.get("raw_bytes"), "sha256": f.get("sha256")}
             for f in source.get("files") or [] if isinstance(f, dict)]
    return {"archive_id": manifest.get("archive_id"), "manifest_sha256": manifest_sha256,
            "source_format": source.get("format"), "source_files": files}


#: The repository file naming the last resume check whose interruption checkpoints were archived there
#: (``check-resume``, ``demo``): its report, its picture, its verdict. The export proof links the picture.
LAST_CHECK_KEY = "last-check.json"
LAST_CHECK_MAX_BYTES = 64 << 10


def write_last_check(repo, record: dict) -> None:
    """Replace ``REPO/last-check.json`` atomically with ``record`` (``kind``, ``created``, ``passed``, ``report``,
    ``picture``, ``generation``).

    Raises:
        NotFound, StoreError, OSError: the repository cannot be opened or written.
    """
    from ckpt_archive.format import jsonio
    from ckpt_archive.repo.repository import Repository

    r = repo if isinstance(repo, Repository) else Repository.open(repo)
    doc = {"format": "ckpt-archive-last-check", "version": 1, **record}
    r.store.replace_bytes(LAST_CHECK_KEY, jsonio.dumps(doc, indent=1, ensure_ascii=True))


def read_last_check(repo) -> dict | None:
    """The last resume check recorded in a repository (:func:`write_last_check`), checked like anything read
    from a repository: at most 64 KiB of strict JSON, every field of its type, text on one line without
    Markdown's backticks; the picture only when that file exists here. None when there is none or it is not
    such a record."""
    import os

    from ckpt_archive.format import jsonio
    from ckpt_archive.format.limits import MAX_SMALL_DOC_COST
    from ckpt_archive.repo.repository import read_small

    try:
        if not repo.store.exists(LAST_CHECK_KEY):
            return None
        doc = jsonio.loads(read_small(repo.store, LAST_CHECK_KEY, LAST_CHECK_MAX_BYTES), where=LAST_CHECK_KEY,
                           max_bytes=LAST_CHECK_MAX_BYTES, max_cost=MAX_SMALL_DOC_COST)
    except Exception:  # noqa: BLE001 - a record that cannot be read (store, size, JSON) links nothing
        return None
    if not isinstance(doc, dict) or doc.get("format") != "ckpt-archive-last-check":
        return None

    def text(v):
        return v if isinstance(v, str) and v.isprintable() and "`" not in v and len(v) < 4096 else None

    rec = {"kind": text(doc.get("kind")), "created": text(doc.get("created")), "report": text(doc.get("report")),
           "picture": text(doc.get("picture")), "passed": doc.get("passed") if isinstance(doc.get("passed"), bool)
           else None, "generation": doc.get("generation") if type(doc.get("generation")) is int else None}
    if rec["kind"] not in ("check-resume", "demo") or rec["passed"] is None or rec["report"] is None:
        return None
    if rec["picture"] is not None and not os.path.isfile(rec["picture"]):
        rec["picture"] = None
    return rec


def write_report(result, path, fmt: str = "markdown") -> None:
    """Write the recovery proof (Markdown or JSON) atomically at ``path`` (a FIFO, device or socket there is
    refused, UsageError exit 2: it is not ours to replace)."""
    from ckpt_archive.format.jsonio import dumps
    from ckpt_archive.ops.common import refuse_special_output
    from ckpt_archive.store.fs import write_file_atomic

    refuse_special_output(path, option="--report")

    data = (dumps(result.to_json(), indent=2, ensure_ascii=True, default=str) if fmt == "json"
            else render_markdown(result).encode("utf-8"))
    write_file_atomic(path, data)  # a fresh O_EXCL temporary beside it, renamed over it (the file layer)


def _cell(value) -> str:
    return "-" if value is None else str(value)


def render_markdown(r) -> str:
    """The recovery proof a person keeps, as Markdown (``r``: an :class:`~ckpt_archive.ops.export.ExportResult`)."""
    lines = _md_head(r)
    for g in r.generations:
        lines += _md_generation(g)
    lines += _md_resume_check(r)
    lines += ["", "## Restore on a new machine", "", "```sh", *r.install_commands, r.verify_command,
              r.restore_command, "```"]
    if "://" in r.destination:
        lines += ["", "Credentials come from the standard AWS environment (`AWS_ACCESS_KEY_ID`, "
                      "`AWS_SECRET_ACCESS_KEY`, or `AWS_PROFILE`)."]
    return "\n".join(lines) + "\n"


def _md_head(r) -> list[str]:
    """The proof's title, result, where from and to, when, bytes moved, and the table of generations."""
    lines = [f"# Recovery proof: {r.destination}", ""]
    lines.append(f"Result: **{'OK, recoverable from the destination' if r.ok else 'FAILED'}**")
    lines += ["", f"- command: `{r.command or 'ckpt_archive.export(...)'}`",
              f"- source: `{r.source}`", f"- destination: `{r.destination}`"]
    if "://" in r.destination:
        lines.append(f"- endpoint: `{r.endpoint_url}`" if r.endpoint_url else "- endpoint: AWS (no custom endpoint)")
        lines.append(f"- region: `{r.region}`" if r.region else "- region: botocore's default")
    lines += [f"- started: {r.started}, finished: {r.finished}",
              f"- bytes copied in this run: {_bytes(r.bytes_copied)}",
              f"- bytes not copied, at the destination before this run (re-read there): "
              f"{_bytes(getattr(r, 'bytes_skipped', 0))}", "", "## Generations", "",
              "| generation | step | epoch | archive id | manifest sha256 | status | bytes copied | bytes skipped |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for g in r.generations:
        lines.append(f"| {g.generation} | {_cell(g.step)} | {_cell(g.epoch)} | `{g.archive_id}` | "
                     f"`{(g.fingerprints or {}).get('manifest_sha256') or ''}` | {g.status} | {g.bytes_copied} | "
                     f"{getattr(g, 'bytes_skipped', 0)} |")
    return lines


def _md_generation(g) -> list[str]:
    """One exported generation: its source fingerprints, the destination listing, what was cleaned, every check,
    and the trial-reload record of its marker."""
    lines: list[str] = []
    files = (g.fingerprints or {}).get("source_files") or []
    if files:
        lines += ["", f"## Generation {g.generation}: source fingerprints "
                      f"({(g.fingerprints or {}).get('source_format')})", "",
                  "| source file | bytes | sha256 |", "| --- | --- | --- |"]
        for f in files:
            lines.append(f"| `{f['path'] or '(the file itself)'}` | {_cell(f['bytes'])} | `{f['sha256'] or ''}` |")
    lines += ["", f"## Generation {g.generation}: destination listing", "",
              "| object | bytes | sha256 | action |", "| --- | --- | --- | --- |"]
    for m in g.members:
        lines.append(f"| `{m['key']}` | {m['bytes'] if m['bytes'] is not None else ''} | "
                     f"`{m['sha256'] or ''}` | {m['action']} |")
    lines += _md_cleaned(g.cleaned or {})
    lines += ["", f"### Generation {g.generation}: checks", "", "| check | member | result | detail |",
              "| --- | --- | --- | --- |"]
    for c in g.checks:
        lines.append(f"| {c.name} | {('`' + c.member + '`') if c.member else ''} | "
                     f"{'ok' if c.ok else '**FAILED**'} | {c.detail} |")
    if g.marker:
        tr = g.marker.get("trial_reload") or {}
        lines += ["", f"Trial-reload record (marker `USABLE.json`): at `{tr.get('where')}` on {tr.get('when')} "
                      f"(host {tr.get('host')}, ckpt-archive {tr.get('tool_version')}): {tr.get('result')}, "
                      f"{_cell(tr.get('tensors'))} tensor(s), {_bytes(tr.get('bytes'))} decoded; manifest "
                      f"sha256 `{g.marker.get('manifest_sha256')}`."]
    return lines


def _md_cleaned(cleaned: dict) -> list[str]:
    """What an interrupted run had left at the destination and this run cleaned (nothing when none)."""
    aborted, removed = cleaned.get("aborted_uploads") or [], cleaned.get("removed") or []
    if not (aborted or removed):
        return []
    return ["", f"Left at the destination by an interrupted run and cleaned now: "
                f"{len(aborted)} unfinished multipart upload(s) aborted "
                f"({', '.join('`' + k + '`' for k in aborted) or 'none'}), "
                f"{len(removed)} stray object(s) removed "
                f"({', '.join('`' + k + '`' for k in removed) or 'none'})."]


def _md_resume_check(r) -> list[str]:
    """The last resume check archived to the source repository, with its picture (nothing when none)."""
    check = getattr(r, "resume_check", None)
    if not check:
        return []
    verdict = "PASSED" if check["passed"] else "FAILED"
    lines = ["", "## Last resume check of the source repository", "",
             f"`ckpt-archive {check['kind']}` of {check['created']}: **{verdict}** (its interruption "
             f"checkpoint is generation {_cell(check['generation'])} of `{r.source}`); report "
             f"`{check['report']}`."]
    if check.get("picture"):
        lines += ["", f"![loss and LR per update of every run of that check]({check['picture']})"]
    return lines


def _bytes(n) -> str:
    """``1536`` -> ``"1536 B (1.5 KiB)"``: exact, and readable."""
    if n is None:
        return "-"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{n} B ({value:.1f} {unit})"


__all__ = ["endpoint_for", "region_for", "env_prefix", "restore_command", "verify_command", "install_commands",
           "fingerprints", "LAST_CHECK_KEY", "LAST_CHECK_MAX_BYTES", "write_last_check", "read_last_check",
           "write_report", "render_markdown"]
