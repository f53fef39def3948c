"""Reader for single ``torch.save`` files, loaded only with ``torch.load(weights_only=True)``.

We never unpickle code: a pickle that references a class or function outside torch's weights-only
allowlist is refused with the global's name. NumPy's own types (arrays, dtypes, scalars, the legacy
RNG tuple's uint32 array) are admitted only on request (``allow_numpy=True``, CLI
``--allow-numpy``), through :func:`numpy_safe_globals`, a narrow allowlist of NumPy reconstruction
functions and classes. Plain-data classes (``argparse.Namespace``, classes named with ``--allow``)
are admitted only inside :func:`ckpt_archive.format.allowlist.allowing`, and only classes whose
instances are a plain ``__dict__`` (see that module); nothing else is ever admitted.
"""
from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

from ckpt_archive.errors import RefusedPickle, SourceError
from ckpt_archive.format.exact_bytes import ZIP_ERRORS, check_zip_records
from ckpt_archive.format.read_lease import ReadLease
from ckpt_archive.sources.base import SourceCheckpoint, SourceFile, library_path, register

_PICKLE_SUFFIXES = {".pt", ".pth", ".bin", ".ckpt", ".tar", ".pkl"}


def numpy_safe_globals() -> list:
    """The NumPy allowlist: exactly what ``torch.save`` emits for NumPy arrays, dtypes and scalars.

    Returns:
        list of NumPy callables/classes to pass to ``torch.serialization.safe_globals``.
    """
    import numpy as np

    try:
        from numpy._core import multiarray as _ma  # NumPy >= 2
    except ImportError:  # pragma: no cover - NumPy 1.x
        from numpy.core import multiarray as _ma
    allowed = [_ma._reconstruct, _ma.scalar, np.ndarray, np.dtype]
    # np.dtype(...) subclasses such as numpy.dtypes.Float32DType appear in pickles of NumPy >= 1.25.
    dtypes_mod = getattr(np, "dtypes", None)
    if dtypes_mod is not None:
        for name in dir(dtypes_mod):
            obj = getattr(dtypes_mod, name)
            if isinstance(obj, type) and issubclass(obj, np.dtype):
                allowed.append(obj)
    return allowed


def _looks_like_torch_file(path: Path) -> bool:
    if not path.is_file():
        return False
    if path.suffix.lower() in _PICKLE_SUFFIXES:
        return True
    with open(path, "rb") as fh:
        head = fh.read(4)
    return head[:2] == b"PK" or head[:1] == b"\x80"


def diagnose_unreadable(path: Path, exc: BaseException | None = None) -> SourceError:
    """Turn a failed ``torch.load`` into a one-line reason naming the file.

    Distinguishes an empty file, a truncated zip (an interrupted write), a file that is not a
    ``torch.save`` file at all, and a pickle that references code (refused).
    """
    size = path.stat().st_size
    where = str(path)
    if size == 0:
        return SourceError("empty file (0 bytes): not a checkpoint", where=where)
    with open(path, "rb") as fh:
        head = fh.read(4)
    msg = str(exc) if exc is not None else ""
    glob = re.search(r"Unsupported global: GLOBAL ([\w.]+)", msg)
    if glob:
        name = glob.group(1)
        if name.startswith("numpy"):
            hint = "it holds NumPy objects: re-run with --allow-numpy to admit NumPy's own types only"
        else:
            from ckpt_archive.format.allowlist import refused_global_hint

            hint = refused_global_hint(name)
        return RefusedPickle(
            f"refused: the pickle references {name}, which torch.load(weights_only=True) does not admit; "
            f"ckpt-archive never unpickles code from files", where=where, hint=hint)
    if head[:2] == b"PK":
        if not zipfile.is_zipfile(path):
            # the end-of-directory record is sought in the last 64 KiB: missing there means the end of the
            # file is gone (the usual case: an interrupted write) or something was appended after it
            return SourceError(f"truncated torch.save file ({size} bytes, the zip directory at its end "
                               f"is missing): it looks like an interrupted write (or bytes were appended "
                               f"after its end)", where=where)
        try:
            with zipfile.ZipFile(path) as zf:
                bad = zf.testzip()
        except ZIP_ERRORS as zexc:
            return SourceError(f"damaged torch.save file: {zexc}", where=where)
        if bad is not None:
            return SourceError(f"damaged torch.save file: record {bad} fails its CRC", where=where)
        names = zipfile.ZipFile(path).namelist()
        if not any(n.endswith("data.pkl") for n in names):
            return SourceError("a zip file, but not a torch.save checkpoint (no data.pkl record)", where=where)
        return SourceError(f"torch.load(weights_only=True) failed: {_first_line(msg)}", where=where)
    if head[:1] == b"\x80":
        if "truncated" in msg or "EOF" in msg or "ran out of input" in msg.lower():
            return SourceError("truncated legacy torch.save file: it looks like an interrupted write", where=where)
        return SourceError(f"torch.load(weights_only=True) failed: {_first_line(msg)}", where=where)
    return SourceError("not a torch.save checkpoint (neither a zip nor a pickle stream)", where=where)


def check_pickle_size(path: Path) -> None:
    """[break] Refuse a zip-format ``torch.save`` file whose ``data.pkl`` declares more than
    :data:`~ckpt_archive.format.limits.MAX_SOURCE_PICKLE_BYTES` raw bytes: both readers (the torch-free one and
    ``torch.load``) hold the pickle whole, and a deflated record decodes to far more than it stores (a 1 MB
    file whose pickle inflated to 1 GiB cost pack 2.3 GB of memory, and was packed). ``torch.save`` never
    compresses a record; a pickle of 100,000 tensors is ~10 MB.

    Raises:
        SourceError: (exit 2) names the record and its declared size.
    """
    from ckpt_archive.format.limits import MAX_SOURCE_PICKLE_BYTES

    try:
        if not zipfile.is_zipfile(path):
            return
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (*ZIP_ERRORS, OSError):
        return  # unreadable: the readers below say why
    for info in infos:
        if info.filename.rsplit("/", 1)[-1] == "data.pkl" and info.file_size > MAX_SOURCE_PICKLE_BYTES:
            raise SourceError(f"record {info.filename} declares {info.file_size} bytes of pickle (stored in "
                              f"{info.compress_size}), more than the {MAX_SOURCE_PICKLE_BYTES} a checkpoint's "
                              f"pickle needs; refused before it is read", where=str(path))


def _all_stored(path: Path) -> bool:
    """Whether every record of a zip is stored uncompressed (False when it cannot be read)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
    except ZIP_ERRORS:
        return False


def _first_line(msg: str) -> str:
    msg = re.sub(r"\x1b\[[0-9;]*m", "", msg)
    for line in msg.splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return "unknown error"


def load_torch_file(path: Path, *, allow_numpy: bool = False, mmap: bool = True, check_crc: bool = True):
    """``torch.load(path, weights_only=True)``, memory-mapped where the file allows it.

    Args:
        path: a ``torch.save`` file.
        allow_numpy: admit :func:`numpy_safe_globals` (NumPy's own types); plain-data classes admitted
            by :func:`ckpt_archive.format.allowlist.allowing` in this context are admitted too, and
            nothing else.
        mmap: map tensor storages from the file instead of reading them (zip-format files only);
            falls back to a plain load for legacy files.
        check_crc: check every zip record's CRC-32 first (:func:`check_zip_records`); False only for a
            caller that checks them itself before trusting anything loaded (pack's early
            :class:`~ckpt_archive.format.exact_bytes.ScanJob`, in the same read as the file's fingerprints).

    Returns:
        the loaded object; tensors are CPU tensors (``map_location="cpu"``).

    Raises:
        SourceError / RefusedPickle: with a one-line reason (see :func:`diagnose_unreadable`).
    """
    import contextlib

    import torch

    path = Path(path)
    if not path.is_file():
        raise SourceError("no such file", where=str(path))
    if path.stat().st_size == 0:
        raise diagnose_unreadable(path)
    check_pickle_size(path)
    from ckpt_archive.format.allowlist import current_allowed

    extra = (numpy_safe_globals() if allow_numpy else []) + list(current_allowed().values())
    ctx = torch.serialization.safe_globals(extra) if extra else contextlib.nullcontext()
    # torch maps only records stored uncompressed (what torch.save writes); a re-zipped, deflated file is read
    # ... and only where the storages it maps can be checked against their records (_check_mapped_storages)
    use_mmap = mmap and zipfile.is_zipfile(path) and _all_stored(path) and os.path.exists(_MAPS)
    if check_crc and (use_mmap or zipfile.is_zipfile(path)):
        check_zip_records(path)  # torch.load does not check CRCs: a flipped byte would load silently
    # [break] a map only under a read lease, held while the tensors live: a file truncated under the map
    # would end the process with SIGBUS; without a lease torch reads the file instead
    lease = None
    if use_mmap:
        try:
            lease = ReadLease(path)
        except OSError:
            pass  # torch.load's own open gives the reason
    use_mmap = use_mmap and lease is not None and lease.held
    try:
        with ctx:
            with library_path(path) as name:
                state = torch.load(name, map_location="cpu", weights_only=True, mmap=use_mmap)
                if use_mmap:
                    _check_mapped_storages(state, name)
                    lease.check()
                    lease.keep_until_gone(*_tensors_in(state, torch))
                    lease = None
                return state
    except SourceError:
        raise
    except Exception as exc:  # torch raises RuntimeError/UnpicklingError/EOFError/...: diagnose them all
        raise diagnose_unreadable(path, exc) from None
    finally:
        if lease is not None:
            lease.close()


_MAPS = "/proc/self/maps"


def _check_mapped_storages(state, path) -> None:
    """[break] Refuse a storage ``torch.load(mmap=True)`` mapped that is not exactly its zip record.

    With ``mmap=True`` torch takes ``numel * itemsize`` bytes (the pickle's word) from the record's start,
    whatever the record holds: a ``data/0`` record of 8 bytes under a pickle declaring 4 float32 gave a
    tensor whose last two values were the next record's zip header, packed as usable -- where
    ``torch.load(weights_only=True)`` without mmap refuses the file ("record size (8 bytes) does not match
    expected size (16 bytes ...)"). Every tensor's storage that lies in this process's mapping of the file
    (``/proc/self/maps``: the mapping's address and file offset give the storage's place in the file) must
    start at a ``data/`` record's bytes and be exactly as long.

    Raises:
        SourceError: (exit 2) names the file offset and the sizes.
    """
    import torch

    from ckpt_archive.format.exact_bytes import zip_records

    maps = _file_mappings(path)
    records = {start: length for start, length, _, name, stored in zip_records(Path(path))
               if stored and "/data/" in name}
    for x in _tensors_in(state, torch):
        try:
            storage = x.untyped_storage()
            ptr, n = storage.data_ptr(), storage.nbytes()
        except Exception:  # noqa: BLE001 - sparse/quantized/nested: storages rebuilt, not the file's
            continue
        at = next((ptr - lo + off for lo, hi, off in maps if lo <= ptr < hi), None)
        if n and at is not None and records.get(at) != n:
            raise SourceError(f"a tensor's storage of {n} bytes at offset {at} of the file is not a record of "
                              f"that size (record: {records.get(at)} bytes): torch.load without mmap refuses "
                              f"this file", where=str(path))


def _file_mappings(path) -> list[tuple[int, int, int]]:
    """This process's mappings of ``path`` (``/proc/self/maps``): (low address, high address, file offset)."""
    st = os.stat(path)
    maps = []
    inode, dev = str(st.st_ino).encode(), f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}".encode()
    with open(_MAPS, "rb") as fh:  # bytes: a mapped file's name need not be UTF-8
        for line in fh:
            parts = line.split()
            if len(parts) >= 6 and parts[4] == inode and parts[3] == dev:
                lo, hi = (int(x, 16) for x in parts[0].split(b"-"))
                maps.append((lo, hi, int(parts[2], 16)))
    return maps


def _tensors_in(state, torch):
    """Every tensor reachable from ``state`` (dict keys and values, sequences, sets, objects' ``__dict__``),
    each once."""
    stack, seen = [state], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            stack.extend(vars(x).values())


def _read(path: Path, *, allow_numpy: bool = False, zip_crc_checked: bool = False, torch_free: bool = False,
          **_ignored) -> SourceCheckpoint:
    """``zip_crc_checked``: the caller checks the zip records' CRC-32 itself (see :func:`load_torch_file`).
    ``torch_free``: [issue 29] read the pickle without importing torch where
    :mod:`ckpt_archive.format.pt_pickle` proves it equal to ``torch.load``'s result (tensors are then
    :class:`~ckpt_archive.format.pt_pickle.PtTensor`, for :mod:`ckpt_archive.format.pt_encode`); anything
    else is loaded with ``torch.load(weights_only=True)`` as always."""
    state = _read_torch_free(path, zip_crc_checked) if torch_free else None
    if state is None:
        state = load_torch_file(path, allow_numpy=allow_numpy, check_crc=not zip_crc_checked)
    return SourceCheckpoint(format="torch-file", layout="file", state=state, root=path.parent,
                            files=[SourceFile("", "torch", path)], info={"filename": path.name})


def _read_torch_free(path: Path, zip_crc_checked: bool):
    """The state read by :func:`ckpt_archive.format.pt_pickle.read`, or None: torch.load reads it."""
    from ckpt_archive.format import pt_pickle

    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0 or not zipfile.is_zipfile(path):
        return None
    check_pickle_size(path)
    if not zip_crc_checked:
        check_zip_records(path)  # as load_torch_file does: a flipped byte would read silently
    try:
        return pt_pickle.read(path)[0]
    except pt_pickle.NotSimple:
        return None


register("torch-file", _looks_like_torch_file, _read, priority=90)


__all__ = ["numpy_safe_globals", "diagnose_unreadable", "check_zip_records", "load_torch_file"]
