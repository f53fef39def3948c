"""``ckpt-archive inspect``: what a generation holds, from its manifest, plus the policy audit (which reads the
state tree and the small scalar tensors such as step counters, never the weights)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pathlib import Path
from typing import List, Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, KEY_FILE_OPTION, TRUST_OPTION, Output, command, exit_codes_help,
                                     exit_with, human_bytes, open_cli_repo, split_repo_spec)
from ckpt_archive.cli.tables import Col, fit

if TYPE_CHECKING:
    from ckpt_archive.ops.inspect import InspectResult


def _readable(tree):
    """An encoded config/metrics tree as a reader expects it: NumPy scalars and non-finite floats as
    numbers / "nan", not the manifest's ``{"$t": "npscalar", "hex": ...}`` tags."""
    import math

    from ckpt_archive.format.state_tree import decode

    try:
        value = decode(tree, lambda key: None)
    except Exception:  # noqa: BLE001 - an odd tree is shown as stored
        return tree

    def plain(v):
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if hasattr(v, "item") and not isinstance(v, (str, bytes)):
            try:
                v = v.item()
            except (TypeError, ValueError):
                return str(v)
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        return v if v is None or isinstance(v, (str, int, float, bool)) else str(v)

    return plain(value)


def register(app: typer.Typer) -> None:
    @app.command("inspect", help="Show a generation's manifest: progress, config, metrics, code, environment, "
                                 "members (opaque ones flagged), tensors, loading instructions."
                 + exit_codes_help({0: "shown",
                                    1: "the generation's manifest or marker is not valid (not JSON, breaks the "
                                       "schema, larger than a reader accepts; the field is named), or its state "
                                       "tree is damaged (shown as far as it reads)",
                                    2: "could not show it (no such generation: the existing ones are listed; not "
                                       "a repository; written by a newer format; its state tree cannot be read "
                                       "here)"}))
    @command
    def inspect_cmd(
        spec: str = typer.Argument(..., metavar="REPO[@GEN]"),
        key_file: Optional[Path] = KEY_FILE_OPTION,
        trust: Optional[List[Path]] = TRUST_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        import ckpt_archive

        out = Output(json_output)
        repo, gen = split_repo_spec(spec)
        info = ckpt_archive.inspect(open_cli_repo(repo, key_file=key_file, trust=trust), gen)
        m = info.manifest
        out.say(f"generation {info.generation} ({info.status}) of {info.location}", style="bold")
        out.say(f"  created {m['created']}  source {m['source']['format']} ({m['source']['layout']})  "
                f"archive id {m['archive_id']}")
        p = m["progress"]
        out.say("  progress: " + "  ".join(f"{k} {'-' if p.get(k) is None else p.get(k)}"
                                             for k in ("step", "epoch", "cursor")))
        code = m["code"]
        out.say(f"  code: {code.get('git_commit') or '-'}{' (dirty)' if code.get('dirty') else ''}"
                f"{'  version ' + str(code['version']) if code.get('version') else ''}")
        env = m["environment"]
        out.say(f"  environment: python {env.get('python')}, torch {env.get('torch')}, numpy {env.get('numpy')}")
        if m["tags"]:
            out.say(f"  tags: {', '.join(m['tags'])}")
        if m["config"]:
            out.say(f"  config: {json.dumps(m['config'], ensure_ascii=False)[:2000]}")
        if m["metrics"]:
            out.say(f"  metrics: {json.dumps(_readable(m['metrics']), ensure_ascii=False)}")
        if m.get("data"):
            d = m["data"]
            out.say(f"  data ids: {d.get('count')} (sha256 {str(d.get('fingerprint'))[:16]})")
        s = m["summary"]
        out.say(f"  {s['tensor_count']} tensors in {s['member_count']} members: {human_bytes(s['raw_bytes'])} raw, "
                f"{human_bytes(s['stored_bytes'])} stored")
        out.table(members_table(m["members"], out.width))
        _say_shared(info, out)
        if info.opaque_members:
            out.say(f"  opaque files (fingerprinted, restored byte for byte, never unpickled): "
                    f"{', '.join(info.opaque_members)}")
        _say_numpy(info, out)
        exact = info.exact_bytes or {}
        if exact.get("files"):
            if exact.get("all_exact"):
                out.say("  exact bytes: restore gives back every source file byte for byte (sha256 checked)")
            else:
                for name, how in exact["files"].items():
                    if how.startswith("not kept"):
                        out.say(f"  exact bytes NOT kept for {name}: {how}", style="yellow")
        out.say("loading instructions:", style="bold")
        out.say(m["instructions"]["text"])
        snippet = m["instructions"].get("snippet")
        if snippet:  # [issue 26] the text above refers to it: show it, runnable as printed for this generation
            gen_no = info.generation
            snippet = (snippet.replace("'REPO'", repr(str(info.location)))
                       .replace("generation='latest'", f"generation={gen_no}")
                       .replace("REPO@latest", f"{info.location}@{gen_no}"))
            out.say("  " + snippet.rstrip("\n").replace("\n", "\n  "))
        _extend_inspect(info, out)
        for p in info.problems:  # [issue 24] what it reports could not be read: never exit 0
            out.error(f"{p.member or p.field or '-'}: {p.reason}")
        out.json(info.to_json())
        exit_with(info)


def _say_numpy(info: InspectResult, out: Output) -> None:
    """[issue 27] Which values of the state are NumPy scalars/dtypes and arrays (the restored file needs NumPy's
    allowlist to load with weights_only=True)."""
    np_ = info.numpy or {}
    sc = np_.get("scalars") or {}
    if sc.get("count"):
        more = f" (+{sc['count'] - len(sc['paths'])} more)" if sc["count"] > len(sc["paths"]) else ""
        out.say(f"  NumPy scalars/dtypes ({sc['count']}; restored as NumPy types, loading the file needs NumPy's "
                f"allowlist): {', '.join(sc['paths'])}{more}")
    if np_.get("arrays"):
        out.say(f"  NumPy arrays ({len(np_['arrays'])}): {', '.join(np_['arrays'][:20])}"
                + (f" (+{len(np_['arrays']) - 20} more)" if len(np_["arrays"]) > 20 else ""))


def _say_shared(info: InspectResult, out: Output) -> None:
    """What the generation stored itself, what it keeps in shared objects, and with which generations (a table
    fitted to the terminal: an object by the first 12 hex digits of its fingerprint, as git shortens commits)."""
    sh = info.shared or {}
    if not sh.get("objects"):
        return
    with_ = ", ".join(f"{n} ({human_bytes(b)})" for n, b in sh["shared_with"].items()) or "no other generation"
    out.say(f"  stored by this generation: {human_bytes(sh['new_stored_bytes'])} of {human_bytes(sh['stored_bytes'])}; "
            f"{len(sh['objects'])} shared object(s), {human_bytes(sh['object_bytes'])}, of which "
            f"{human_bytes(sh['shared_bytes'])} shared with generation(s) {with_}; "
            f"only here: {human_bytes(sh['only_here_bytes'])} (what forgetting it would free)")
    shown = 10
    rows = []
    for o in sh["objects"][:shown]:
        others = [n for n in o["generations"] if n != info.generation]
        short = o["key"].rsplit("/", 1)[-1][:12]
        rows.append([short, human_bytes(o["stored_bytes"]), ", ".join(o["entries"]), ", ".join(map(str, others)) or "-"])
    cols = (Col("object", "object"), Col("stored", "stored", justify="right"),
            Col("entries", "entries", kind="text", min_width=12), Col("also", "also used by", kind="prose", min_width=12))
    out.table(fit(cols, rows, out.width, title="shared objects", degrade=(("cut", "entries"),)))
    if len(sh["objects"]) > shown:
        out.say(f"    ... {len(sh['objects']) - shown} more (--json lists every one)")


def _extend_inspect(info: InspectResult, out: Output) -> None:
    """The policy audit (LR the next step will use, counters, findings) as a table; ``--json`` prints it with
    the rest of :meth:`InspectResult.to_json`."""
    from ckpt_archive.cli.policy_views import cli_inspect

    cli_inspect(info, out)


#: inspect's members table; on a narrow terminal the fingerprint goes first, then the codecs, and the member's
#: path is cut (the sizes never are).
MEMBER_COLUMNS = (Col("member", "member", kind="text", min_width=16), Col("role", "role", kind="text", min_width=7),
                  Col("raw", "raw", justify="right"), Col("stored", "stored", justify="right"),
                  Col("codecs", "codecs", kind="text", min_width=6), Col("fp", "raw fingerprint"))
MEMBER_DEGRADE = (("drop", "fp"), ("cut", "codecs"), ("drop", "codecs"), ("cut", "role"), ("cut", "member"))


def members_table(members: list[dict], width: int):
    """The manifest's members as a table fitted to ``width`` (:func:`ckpt_archive.cli.tables.fit`)."""
    rows = [[mem["path"], mem["role"] + (" (opaque: never loaded)" if mem.get("opaque") else ""),
             human_bytes(mem["raw_bytes"]), human_bytes(mem["stored_bytes"]), ",".join(mem.get("chunk_codecs", [])),
             _short_fp(mem)] for mem in members]
    return fit(MEMBER_COLUMNS, rows, width, title="members", degrade=MEMBER_DEGRADE)


def _short_fp(mem: dict) -> str:
    """``blake3:3ab54706800b`` (format 2 records the algorithm; format 1's is sha256)."""
    from ckpt_archive.format.fingerprint import raw_fp

    alg, _, hexd = (raw_fp(mem) or "").partition(":")
    return f"{alg}:{hexd[:12]}"


__all__ = ["register", "MEMBER_COLUMNS", "MEMBER_DEGRADE", "members_table"]
