"""The manifest: one JSON document per generation, validated against its version's schema
(``schemas/manifest.v<N>.schema.json``) on write and on every read; format versions and the refusal of
newer ones.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import pkgutil

from ckpt_archive.errors import FormatError, ManifestInvalid, NewerFormatError
from ckpt_archive.format import jsonio

FORMAT = "ckpt-archive"
#: Format 2: format 1's layout and chunk encoding with fingerprints that carry their algorithm, one hash
#: per role (docs/FORMAT.md, "Fingerprints" and "Versions"). Format 1 readers refuse it by name.
FORMAT_VERSION = 2
#: Format 3, a minor step: format 2 plus shared objects (members[].objects) and the sign-rotated float chunk
#: codecs (docs/FORMAT.md, "Shared objects", "Member encoding"). A manifest is written as format 3 only when it
#: uses one of these (:func:`version_for`), so a format-2 reader still reads every generation it can and
#: refuses the others by name instead of misreading a member whose bytes live partly elsewhere.
FORMAT_VERSION_SHARED = 3
#: Chunk codecs that only format 3 may name.
FORMAT3_CODECS = frozenset({"bg2r+zstd", "bg4r+zstd", "bg8r+zstd"})
#: Versions this reader understands (every older one stays readable forever), with their schemas.
SCHEMAS = {1: "manifest.v1.schema.json", 2: "manifest.v2.schema.json", 3: "manifest.v3.schema.json"}
KNOWN_VERSIONS = tuple(SCHEMAS)


@functools.lru_cache(maxsize=None)
def schema(name: str = "manifest.v1.schema.json") -> dict:
    """Load a JSON Schema shipped in ``ckpt_archive/schemas`` (also at the repository's ``schemas/``)."""
    return jsonio.loads(schema_bytes(name), where=name)


def schema_bytes(name: str) -> bytes:
    """The bytes of a JSON Schema shipped in ``ckpt_archive/schemas``, read through the package's loader
    (``pkgutil.get_data``: ``importlib.resources`` costs every command ~10 ms of start-up, issue 29)."""
    raw = pkgutil.get_data("ckpt_archive", f"schemas/{name}")
    if raw is None:  # pragma: no cover - a loader that cannot read data files
        raise FileNotFoundError(f"ckpt_archive/schemas/{name}")
    return raw


def version_for(members: list[dict]) -> int:
    """The format version a new manifest with these member records is written as: 3 when a member keeps
    bytes in shared objects or a chunk uses a format-3 codec, else 2 (:data:`FORMAT_VERSION`)."""
    for m in members:
        if m.get("objects") or any(c.get("codec") in FORMAT3_CODECS for c in m.get("chunks") or ()):
            return FORMAT_VERSION_SHARED
    return FORMAT_VERSION


@functools.lru_cache(maxsize=None)
def _validator(name: str):
    """The schema's validator, built once per process (validators keep no state between documents)."""
    import jsonschema

    s = schema(name)
    cls = jsonschema.validators.validator_for(s)
    # JSON Schema counts 64.0 as an integer (draft 6 on); every reader indexes, slices and allocates with
    # these fields, where a float is a TypeError deep inside a command: only JSON integers pass
    strict = jsonschema.validators.extend(cls, type_checker=cls.TYPE_CHECKER.redefine("integer", _is_int))
    return strict(s, format_checker=cls.FORMAT_CHECKER)


def _is_int(checker, instance) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


#: What a verdict of :func:`validate` depends on beyond the schema's bytes and the validator's version
#: (part of :func:`_schema_key`): change it when the validation itself changes.
_VALIDATION_RULES = b"integers-are-json-integers"


def validate(doc: dict, *, where: str = "manifest.json", schema_name: str | None = None) -> None:
    """Validate against a schema (default: the one of the manifest's ``format_version``); raise
    ManifestInvalid (exit 1) naming the first failing field path."""
    if schema_name is None:
        schema_name = SCHEMAS.get(doc.get("format_version"), SCHEMAS[FORMAT_VERSION])
    errors = sorted(_validator(schema_name).iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        field = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ManifestInvalid(f"breaks the schema at field {field}: {e.message[:300]}{more}", where=where)


def dumps(doc: dict) -> bytes:
    """Strict JSON (RFC 8259: no NaN/Infinity; :func:`ckpt_archive.format.jsonio.dumps`), UTF-8, stable key
    order as built."""
    try:
        return jsonio.dumps(doc, indent=1)
    except ValueError as exc:
        raise FormatError(f"manifest is not strict JSON: {exc}") from None


def sha256_hex(data) -> str:
    """sha256 (hex) of any bytes-like object (``bytes``, ``bytearray``, ``memoryview`` of any format, mmap)."""
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


#: sha256 digests of manifest bytes that passed every check of :func:`parse` in this process (most recent
#: last). The checks are pure functions of the bytes, so the same bytes read again (``resolve`` reads every
#: generation, a command reads its generation more than once) skip the schema validation (~50 ms for a
#: chunk table of a few hundred entries) and the path/size checks; the JSON is parsed afresh every time
#: (callers own their dict) and the format name and version are checked every time.
_PASSED: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()
_PASSED_MAX = 512


def _validated_marker(digest: bytes, schema_name: str):
    """The user-cache file that says these manifest bytes passed ``schema_name`` before, in any process:
    ``$XDG_CACHE_HOME/ckpt-archive/validated/<schema key>/<hh>/<sha256 hex>`` (empty). The key
    (:func:`_schema_key`) changes with the schema, the tool or the validator, so none reuses a verdict.
    It lives in the user's cache, never in a repository: nothing an archive carries can vouch for itself.
    None when no cache folder can be named (``CKPT_ARCHIVE_NO_CACHE`` set, no home)."""
    import os
    from pathlib import Path

    if os.environ.get("CKPT_ARCHIVE_NO_CACHE"):
        return None
    xdg = os.environ.get("XDG_CACHE_HOME") or ""
    try:  # a relative XDG_CACHE_HOME is ignored (XDG Base Directory spec): it could name a repository
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    except RuntimeError:  # no home directory
        return None
    hexd = digest.hex()
    return base / "ckpt-archive" / "validated" / _schema_key(schema_name) / hexd[:2] / hexd


@functools.lru_cache(maxsize=None)
def _schema_key(schema_name: str) -> str:
    """The schema's bytes, this tool's version, and what decides a verdict in the validator: jsonschema's
    version and whether its ``date-time`` checker can run (it needs ``rfc3339-validator``) -- looked up
    without importing jsonschema, which a remembered verdict saves."""
    import importlib.util

    from ckpt_archive import __version__

    validator = _installed_version("jsonschema")
    checker = importlib.util.find_spec("rfc3339_validator") is not None
    raw = schema_bytes(schema_name)
    return hashlib.sha256(b"\0".join([raw, __version__.encode(), validator.encode(), str(checker).encode(),
                                      _VALIDATION_RULES])).hexdigest()[:16]


def _installed_version(name: str) -> str:
    """The installed version of distribution ``name`` (a plain name: ``jsonschema``), "?" when none is found.

    Read from the name of the ``NAME-VERSION.dist-info`` folder beside the package (the wheel layout
    every installer writes) when exactly one is there: ``importlib.metadata`` imports the ``email`` package
    to parse metadata, ~0.03 s of every read-only command's start-up [issue 29]. Any other layout asks
    ``importlib.metadata``. The package itself is not imported."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    places = list(spec.submodule_search_locations or ()) if spec is not None else []
    for place in places:
        try:
            found = [e for e in os.listdir(os.path.dirname(place))
                     if e.startswith(name + "-") and e.endswith(".dist-info")]
        except OSError:
            continue
        if len(found) == 1:
            return found[0][len(name) + 1:-len(".dist-info")]
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _validated_before(digest: bytes, schema_name: str) -> bool:
    import os
    import stat

    marker = _validated_marker(digest, schema_name)
    try:
        return marker is not None and stat.S_ISREG(os.lstat(marker).st_mode)  # a link is no verdict
    except OSError:
        return False


def seal_bytes(doc: dict, *, where: str = "manifest.json") -> bytes:
    """The bytes of a new manifest, checked against its schema *as those bytes read back* (strict JSON
    writes a NaN as a tagged object, which a reader's schema pass would refuse), and their verdict
    remembered for the reads that follow (trial reload, verify, list: ~45 µs per chunk-table row saved).

    Raises:
        ManifestInvalid: the bytes break the schema (nothing is written; the caller refuses the generation).
        FormatError: (exit 2) not strict JSON, or larger than readers accept (``limits.MAX_MANIFEST_BYTES``,
            ``limits.MAX_MANIFEST_COST``).
    """
    from ckpt_archive.format.limits import MAX_MANIFEST_BYTES, MAX_MANIFEST_COST

    raw = dumps(doc)
    schema_name = SCHEMAS.get(doc.get("format_version"), SCHEMAS[FORMAT_VERSION])
    # the limits every reader applies (format/limits.py): a manifest no reader would read is never written
    cost = jsonio.parse_cost(raw) if len(raw) <= MAX_MANIFEST_BYTES else None
    if cost is None or cost > MAX_MANIFEST_COST:
        raise FormatError(f"the manifest would be {len(raw)} bytes" + (f" (about {cost} bytes to parse)" if cost else "")
                          + f"; readers accept at most {MAX_MANIFEST_BYTES} bytes and {MAX_MANIFEST_COST} to parse "
                            f"(about 120,000 tensors per generation); nothing was published", where=where)
    validate(jsonio.loads(raw, where=where), where=where, schema_name=schema_name)
    _mark_validated(hashlib.sha256(raw).digest(), schema_name)
    return raw


def _mark_validated(digest: bytes, schema_name: str) -> None:
    marker = _validated_marker(digest, schema_name)
    if marker is None:
        return
    import os

    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644))
    except OSError:  # unwritable, or a link where the marker goes (never written through)
        pass


def parse(data: bytes, *, where: str = "manifest.json") -> dict:
    """Parse and check a manifest: JSON, format name, version (refuse newer), schema.

    Bytes that passed every check before in this process are not validated again (see ``_PASSED``); bytes
    whose schema pass is recorded in the user's cache (:func:`_validated_marker`, any earlier process)
    skip that pass only -- the path and size checks run every time.

    Raises:
        UnsafePath / ImplausibleSize: a path that is not a plain relative path, a size that cannot be
            true (exit 1; ``format/paths.py``, ``format/limits.py``).
        ManifestInvalid: not strict JSON (:func:`ckpt_archive.format.jsonio.loads`: also a duplicate key,
            NaN/Infinity, too large or too deep), not a ckpt-archive manifest, or breaks the schema (exit 1).
        NewerFormatError: written by a newer format version than this reader knows.
    """
    if not data:
        raise ManifestInvalid("empty manifest", where=where)
    from ckpt_archive.format.limits import MAX_MANIFEST_BYTES, MAX_MANIFEST_COST

    doc = jsonio.loads(data, where=where, max_bytes=MAX_MANIFEST_BYTES, max_cost=MAX_MANIFEST_COST)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestInvalid("not a ckpt-archive manifest (field 'format' is not 'ckpt-archive')", where=where)
    version = doc.get("format_version")
    if not isinstance(version, int):
        raise ManifestInvalid("field format_version is missing or not an integer", where=where)
    if version > max(KNOWN_VERSIONS):
        raise NewerFormatError(f"written by format {version}, this reader knows up to {max(KNOWN_VERSIONS)}; "
                               f"upgrade ckpt-archive to read it", where=where)
    if version not in KNOWN_VERSIONS:
        raise FormatError(f"unknown format version {version}", where=where)
    passed = hashlib.sha256(data.encode() if isinstance(data, str) else data).digest()
    if passed in _PASSED:
        _PASSED.move_to_end(passed)
        return doc
    schema_name = SCHEMAS[version]
    if not _validated_before(passed, schema_name):  # the schema verdict is a pure function of the bytes
        validate(doc, where=where)
        _mark_validated(passed, schema_name)
    # hostile until checked (docs/FORMAT.md, "Reading hostile archives"): every path it names is a plain
    # relative path, every size it declares can be true -- before any reader allocates or opens anything
    from ckpt_archive.format.limits import check_manifest_sizes
    from ckpt_archive.format.paths import check_manifest_paths

    check_manifest_paths(doc, where=where)
    check_manifest_sizes(doc, where=where)
    check_manifest_refs(doc, where=where)
    _PASSED[passed] = None
    while len(_PASSED) > _PASSED_MAX:
        _PASSED.popitem(last=False)
    return doc


def check_manifest_refs(doc: dict, *, where: str = "manifest.json") -> None:
    """Every name the manifest uses for another of its parts names a part of the right kind: the tree
    member has role ``tree``; every tensor record names a member of role ``tensors`` that lists the
    record's entry; source files have distinct relpaths, none inside another (:func:`check_source_relpaths`).
    The schema cannot say this (the names are data); a hand-made manifest that breaks it
    would otherwise fail as a ``KeyError`` deep inside whichever command reads it first.

    Runs after the schema check (``members`` is a list of objects with ``path`` and ``role``).

    Raises:
        ManifestInvalid: (exit 1) naming the field that points at the wrong part.
    """
    members = {m["path"]: m for m in doc["members"]}
    tree = members.get(doc["tree_member"])
    if tree is None or tree["role"] != "tree":
        what = "names no member" if tree is None else f"names a member of role {tree['role']!r}"
        raise ManifestInvalid(f"tree_member {doc['tree_member']!r} {what}, not the state tree", where=where)
    for leaf, rec in doc["tensors"].items():
        m = members.get(rec["member"])
        if m is None or m["role"] != "tensors":
            what = "names no member" if m is None else f"names a member of role {m['role']!r}"
            raise ManifestInvalid(f"tensor {leaf!r}: member {rec['member']!r} {what}, not a tensors member",
                                  where=where)
        if rec["entry"] not in m["entries"]:
            raise ManifestInvalid(f"tensor {leaf!r}: entry {rec['entry']!r} is not in member {rec['member']!r}",
                                  where=where)
    check_source_relpaths(doc, where=where)


def check_source_relpaths(doc: dict, *, where: str = "manifest.json") -> None:
    """``source.files[].relpath`` names one file each: no relpath twice, and none that is a folder of
    another (a file ``a`` and a file ``a/b``). Either way restore would write one file over another, or
    fail half-way; verify and the trial reload would pass it. Names differing only by case or Unicode
    normalisation are distinct here (they are on Linux); restore creates each file exclusively, so a file
    system that folds them refuses the second instead of overwriting the first.

    Raises:
        ManifestInvalid: (exit 1) naming the relpath.
    """
    seen: set[str] = set()
    for f in (doc.get("source") or {}).get("files") or []:
        rel = f.get("relpath") if isinstance(f, dict) else None
        if not isinstance(rel, str):
            continue  # the schema and the path rule speak for it
        if rel in seen:
            raise ManifestInvalid(f"source.files: relpath {rel!r} is listed twice", where=where)
        seen.add(rel)
    for rel in seen:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in seen:
                raise ManifestInvalid(f"source.files: relpath {rel!r} lies inside {folder!r}, which is listed "
                                      f"as a file", where=where)


__all__ = ["FORMAT", "FORMAT_VERSION", "FORMAT_VERSION_SHARED", "FORMAT3_CODECS", "SCHEMAS", "KNOWN_VERSIONS", "schema", "schema_bytes",
           "version_for", "validate", "dumps", "sha256_hex", "seal_bytes", "parse", "check_manifest_refs",
           "check_source_relpaths"]
