"""Nested training state <-> (strict-JSON tree, tensor table).

Why one long module (over the ~600 guide): encode and decode are the two halves of one contract
(docs/FORMAT.md "State tree") and must change together, tag by tag; splitting them apart made every new
tag a two-file edit that could drift. What is not a tag of the tree lives apart: a tensor's bytes, dtype
names and lazy view bits (:mod:`ckpt_archive.format.tensor_bytes`), walking an encoded tree (nodes, tensor
references, shared/ref aliasing: :mod:`ckpt_archive.format.tree_walk`, the readers' concern), a rebuild
node's torch function (:mod:`ckpt_archive.format.rebuild`).

:func:`encode` walks a nested state (dict / OrderedDict / list / tuple, tensors, NumPy arrays and
scalars, plain values) and returns a JSON-able tree whose tensor leaves point at keys of a
:class:`TensorTable`; :func:`decode` rebuilds the exact object from the tree and a tensor getter. The
encoding rules are in docs/FORMAT.md ("State tree"): what JSON lacks (non-finite floats, ints beyond
2^53, tuples, bytes, non-str keys) is tagged with ``"$t"``. What may be encoded is the rule of
docs/FORMAT.md ("What round-trips"): everything ``torch.load(weights_only=True)`` accepts, with its
exact type (see :mod:`ckpt_archive.format.allowlist`), plus admitted NumPy and plain-data classes;
anything else is refused naming its path and type, never stored as a lookalike.

Storage sharing follows torch's own model: tensors are grouped by their underlying storage. A storage
viewed by exactly one tensor that covers it contiguously is stored under the tensor's shape ("natural");
a storage shared by several tensors (tied weights, views) or viewed non-contiguously is stored once and
each tensor records its view, so aliasing comes back on restore.
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import math
import sys
from typing import Any, Callable

from ckpt_archive.errors import CkptArchiveError, FormatError, MalformedTree, SourceError, first_line
from ckpt_archive.format.text import shown, str_from_node, str_node, utf8_ok
from ckpt_archive.format.allowlist import (class_name, current_allowed, decode_class, global_name,
                                           plain_class_problem, refusal, resolve_global)
from ckpt_archive.format.rebuild import holds_stub, rebuild
from ckpt_archive.format.tensor_bytes import (NUMPY_TO_ST, TORCH_TO_ST, c_strides, check_view_size, storage_u8,
                                             tensor_u8, tensor_u8_pieces, view_bits)

MAX_SAFE_INT = 2**53

@dataclasses.dataclass
class Entry:
    """One tensor stored in a tensors shard.

    Attributes:
        key: the entry's name in the safetensors header.
        st_dtype: safetensors dtype string (``"F32"``, ``"BF16"``, ... or ``"U8"`` for raw bytes).
        shape: the stored shape (flat ``[n]`` for shared storages).
        source: a zero-copy way to get the bytes: a callable returning a 1-D uint8 NumPy array
            (contiguous, CPU). Called once, when the entry is written.
        nbytes: number of bytes (== prod(shape) * itemsize).
    """

    key: str
    st_dtype: str
    shape: list[int]
    source: Callable[[], Any]
    nbytes: int


@dataclasses.dataclass
class TensorTable:
    """What :func:`encode` found: stored entries and, per tree leaf, how to rebuild it.

    ``leaves`` maps a leaf key to its manifest record (without ``raw_sha256`` of natural entries, which
    the writer fills from the stored bytes): ``entry``, ``kind`` ("torch" | "numpy"), ``dtype`` (torch
    dtype name or NumPy ``dtype.str``), ``shape``, and for views ``view`` = {storage_offset, stride}
    (in elements), for non-CPU tensors ``device``; ``leaf_bytes`` gives view leaves' contiguous bytes, as an iterable of pieces (bounded memory whatever the view's size)
    for their own sha256.
    """

    entries: dict[str, Entry] = dataclasses.field(default_factory=dict)
    leaves: dict[str, dict] = dataclasses.field(default_factory=dict)
    leaf_bytes: dict[str, Callable[[], Any]] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)
    #: paths (``rng/np/2``) of NumPy scalars and dtypes in the state, in encoding order: values a reader of the
    #: restored file needs NumPy's allowlist for (``--allow-numpy``); NumPy arrays are tensor leaves (``kind``)
    numpy_values: list[str] = dataclasses.field(default_factory=list)


def _torch():
    import torch

    return torch


def _is_tensor(obj) -> bool:
    torch = _torch()
    return isinstance(obj, torch.Tensor)


def _float(v: float):
    if math.isfinite(v):
        return v
    return {"$t": "float", "v": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}


def _plain_json_list(obj: list) -> bool:
    """Whether every element of a list is its own JSON encoding: all safe-range ints, all finite floats or
    all UTF-8 str (what :meth:`Encoder._enc` would return unchanged, one element at a time)."""
    kinds = set(map(type, obj))
    if kinds == {int}:
        return -MAX_SAFE_INT <= min(obj) and max(obj) <= MAX_SAFE_INT
    if kinds == {float}:
        return all(map(math.isfinite, obj))
    if kinds == {str}:
        return all(map(utf8_ok, obj))
    return False


def _plain_state(obj, path) -> dict:
    """The ``__dict__`` of an admitted plain-data object (str keys only)."""
    why = plain_class_problem(type(obj))
    if why is not None:
        raise refusal(_path_name(path), obj, why)
    state = vars(obj)
    if not all(type(k) is str and utf8_ok(k) for k in state):
        raise refusal(_path_name(path), obj, "its __dict__ has keys that are not UTF-8 text")
    return dict(state)


def _path_name(path: tuple) -> str:
    parts = [shown(p) if type(p) is str else str(p) for p in path]
    return "/".join(parts) if parts else "value"


#: what a JSON parser gives for a scalar: each decodes to itself
_JSON_ATOMS = frozenset({int, float, str, bool, type(None)})
#: types whose values are immutable: never counted for sharing
_ATOM_TYPES = frozenset({int, float, str, bool, type(None), bytes, complex})


class Encoder:
    """The encoder behind :func:`encode`: ``enc(state, ())`` gives the tree, then ``finish_tensors()`` fills
    ``table`` (a :class:`TensorTable`). Subclassed where a caller notes more per tensor
    (:mod:`ckpt_archive.format.pt_encode`, the distributed Checkpointer's shard-aware encoder).

    Args:
        allow: plain-data classes admitted besides torch's allowlist (default: the current
            :func:`~ckpt_archive.format.allowlist.allowing` context).

    Raises:
        SourceError: (from ``enc``) a value that cannot round-trip exactly, as :func:`encode` says.
    """

    def __init__(self, allow=None):
        allow = current_allowed() if allow is None else allow
        self.allow = {class_name(c) if isinstance(c, type) else str(c) for c in allow}
        self.table = TensorTable()
        self._tensor_leaves: list[tuple[str, Any]] = []  # (leaf key, tensor)
        self._used: set[str] = set()
        self._multi: set[int] = set()          # ids of containers/tensors met more than once (count_shared)
        self._shared: dict[int, int] = {}      # id -> shared number, once encoded
        self._open: set[int] = set()           # containers being encoded (a cycle is refused)
        self._keep: list = []                  # keeps every counted container alive (ids stay unique)

    def count_shared(self, root) -> None:
        """First pass: find the mutable values (list, dict and dict subclasses, set, bytearray, admitted
        plain-data objects), tensors, storages and NumPy arrays reached more than once, so that they are
        encoded once and referenced after: torch.save's pickle memo keeps that identity (``state["a"] is
        state["b"]`` after ``torch.load``), and an in-place change through one name must show through the
        other after a restore too."""
        leaf_types = self._leaf_types()
        atoms = _ATOM_TYPES  # immutable: their identity is nobody's business (and a sampler's list is long)
        seen: set[int] = set()
        stack = [root]
        while stack:
            obj = stack.pop()
            tp = type(obj)
            if tp in atoms:
                continue
            admitted = bool(self.allow) and class_name(tp) in self.allow and hasattr(obj, "__dict__")
            if isinstance(obj, leaf_types) or admitted:
                if id(obj) in seen:
                    self._multi.add(id(obj))
                else:
                    seen.add(id(obj))
                    self._keep.append(obj)
                    if admitted:  # an admitted plain-data object (argparse.Namespace): its fields may share too
                        stack.extend(vars(obj).values())
                continue
            if not isinstance(obj, (list, dict, set)):
                if type(obj) is tuple:
                    stack.extend(obj)
                continue
            if id(obj) in seen:
                self._multi.add(id(obj))
                continue
            seen.add(id(obj))
            self._keep.append(obj)
            if isinstance(obj, dict):
                stack.extend([k for k in obj.keys() if type(k) not in atoms])
                stack.extend([v for v in obj.values() if type(v) not in atoms])
            else:
                stack.extend([v for v in obj if type(v) not in atoms])

    def _leaf_types(self) -> tuple:
        """Leaf types counted for sharing; torch's and NumPy's only once imported (none of their objects
        exists before: a state read without either, e.g. format/pt_pickle.py's, never imports them here)."""
        torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
        return ((bytearray,) + ((np.ndarray,) if np else ())
                + ((torch.Tensor, torch.UntypedStorage, torch.TypedStorage) if torch else ()))

    def _leaf_key(self, path: tuple) -> str:
        base = _path_name(path)
        key, n = base, 1
        while key in self._used:
            n += 1
            key = f"{base}#{n}"
        self._used.add(key)
        return key

    def enc(self, obj: Any, path: tuple) -> Any:
        """Encode one value; a container, tensor or array met before is a ``ref`` to its first (``shared``)
        encoding."""
        oid = id(obj)
        if oid not in self._multi:
            return self._enc(obj, path)
        if oid in self._open:
            raise refusal(_path_name(path), obj, "it contains itself (a cycle)")
        if oid in self._shared:
            return {"$t": "ref", "id": self._shared[oid]}
        self._open.add(oid)
        try:
            node = self._enc(obj, path)
        finally:
            self._open.discard(oid)
        self._shared[oid] = n = len(self._shared) + 1
        return {"$t": "shared", "id": n, "v": node}

    def _enc(self, obj: Any, path: tuple) -> Any:
        """Encode one value; every type is matched exactly (a subclass is never stored as its base). The kinds
        are tried in this order: scalars, arrays and torch's objects (and what torch's allowlist names),
        containers, then an admitted plain-data class; anything else is refused."""
        node = self._enc_scalar(obj, path)
        if node is _UNMATCHED:
            node = self._enc_array_or_torch(obj, path)
        if node is _UNMATCHED:
            node = self._enc_container(obj, path)
        if node is not _UNMATCHED:
            return node
        cname = class_name(type(obj))
        if cname in self.allow:
            return {"$t": "object", "class": cname,
                    "state": {k: self.enc(v, path + (k,)) for k, v in _plain_state(obj, path).items()}}
        raise refusal(_path_name(path), obj)

    def _enc_scalar(self, obj: Any, path: tuple) -> Any:
        """None, str, bool, NumPy scalars, int, float, complex, bytes and bytearray (else ``_UNMATCHED``)."""
        np = sys.modules.get("numpy")  # None: no NumPy object can exist (see _leaf_types)

        tp = type(obj)
        if tp is str and not utf8_ok(obj):
            # lone surrogates (a non-UTF-8 file name through os.fsdecode): JSON text cannot carry them
            return str_node(obj)
        if obj is None or tp is str or tp is bool:
            return obj
        if np is not None and isinstance(obj, np.generic):  # before float: np.float64 subclasses float
            if obj.dtype.kind == "O":
                raise SourceError("NumPy object scalar is not plain data", where=_path_name(path))
            self.table.numpy_values.append(_path_name(path))
            return {"$t": "npscalar", "dtype": obj.dtype.str, "hex": obj.tobytes().hex()}
        if tp is int:
            return obj if -MAX_SAFE_INT <= obj <= MAX_SAFE_INT else {"$t": "int", "v": str(obj)}
        if tp is float:
            return _float(obj)
        if tp is complex:
            return {"$t": "complex", "re": _float(obj.real), "im": _float(obj.imag)}
        if tp is bytes or tp is bytearray:
            return {"$t": tp.__name__, "b64": base64.b64encode(bytes(obj)).decode("ascii")}
        return _UNMATCHED

    def _enc_array_or_torch(self, obj: Any, path: tuple) -> Any:
        """Tensors, NumPy arrays and dtypes, torch's dtype/Size/device/layout/storages, and any other object
        torch's weights-only allowlist names (else ``_UNMATCHED``)."""
        torch = sys.modules.get("torch")  # None: no torch object can exist (see _leaf_types)
        np = sys.modules.get("numpy")  # likewise for NumPy

        tp = type(obj)
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if np is not None and tp is np.ndarray:
            return self._ndarray(obj, path)
        if np is not None and isinstance(obj, np.dtype):
            self.table.numpy_values.append(_path_name(path))
            return {"$t": "npdtype", "v": obj.str}
        if torch is None:
            pass
        elif tp is torch.dtype:
            return {"$t": "dtype", "v": str(obj).replace("torch.", "")}
        elif tp is torch.Size:
            return {"$t": "size", "v": [int(x) for x in obj]}
        elif tp is torch.device:
            return {"$t": "device", "v": str(obj)}
        elif tp is torch.layout:
            return {"$t": "layout", "v": str(obj).replace("torch.", "")}
        elif tp is torch.UntypedStorage or tp is torch.TypedStorage:
            return self._storage(obj, path)
        # the allowlist is read from torch; besides torch's own objects it names classes and functions only
        name = global_name(obj) if torch is not None or callable(obj) else None
        if name is not None:  # an object torch's allowlist itself names: qscheme, legacy tensor class, ...
            return {"$t": "global", "v": name}
        return _UNMATCHED

    def _enc_container(self, obj: Any, path: tuple) -> Any:
        """tuple, list, set, OrderedDict, Counter and dict, their items encoded (else ``_UNMATCHED``)."""
        tp = type(obj)
        if tp is tuple:
            return {"$t": "tuple", "v": [self.enc(v, path + (i,)) for i, v in enumerate(obj)]}
        if tp is list:
            if len(obj) > 16 and _plain_json_list(obj):  # a sampler's permutation, a loss history: as is
                return list(obj)
            return [self.enc(v, path + (i,)) for i, v in enumerate(obj)]
        if tp is set:
            return {"$t": "set", "v": [self.enc(v, path + (i,)) for i, v in enumerate(obj)]}
        if tp is collections.OrderedDict or tp is collections.Counter:
            node = {"$t": "odict" if tp is collections.OrderedDict else "counter",
                    "items": self._items(obj, path)}
            attrs = dict(vars(obj))
            if attrs:
                node["attrs"] = self._attrs(obj, attrs, path)
            return node
        if tp is dict:
            if all(type(k) is str and utf8_ok(k) for k in obj) and "$t" not in obj:
                return {k: self.enc(v, path + (k,)) for k, v in obj.items()}
            return {"$t": "dict", "items": self._items(obj, path)}
        return _UNMATCHED

    def _attrs(self, obj, attrs: dict, path) -> dict:
        """Encoded Python attributes of a tensor or OrderedDict (names must be UTF-8 text: JSON keys)."""
        if not all(type(k) is str and utf8_ok(k) for k in attrs):
            raise refusal(_path_name(path), obj, "it has attributes whose names are not UTF-8 text")
        return {k: self.enc(v, path + ("attrs", k)) for k, v in attrs.items()}

    def _items(self, obj, path) -> list:
        return [[self.enc(k, path + ("key",)), self.enc(v, path + (k,))] for k, v in obj.items()]

    def _tensor(self, t, path) -> dict:
        """A tensor: dense ones go to the tensor table; sparse, quantized, nested and meta tensors are
        taken apart the way ``torch.save`` does (its own rebuild function and arguments), so their
        dense parts are stored by the codec and torch's rebuild function puts them back together."""
        torch = _torch()
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise refusal(_path_name(path), t, "a tensor subclass; weights_only accepts torch.Tensor and "
                                               "torch.nn.Parameter only")
        attrs = dict(vars(t)) if getattr(t, "__dict__", None) else {}
        dense = (t.layout == torch.strided and not t.is_quantized and not t.is_nested
                 and t.device.type != "meta")
        if dense:
            _probe_bytes(t, _path_name(path))
            key = self._leaf_key(path)
            self._tensor_leaves.append((key, t))
            node: dict = {"$t": "tensor", "key": key}
        else:
            func, args = torch.Tensor._reduce_ex_internal(t, 2)
            fname = global_name(func)
            if fname is None or not fname.startswith("torch._utils._rebuild"):
                raise refusal(_path_name(path), t, f"torch.save rebuilds it with {func!r}, not an allowlisted "
                                                   f"rebuild function")
            node = {"$t": "rebuild", "f": fname,
                    "args": [self.enc(a, path + (f"<{i}>",)) for i, a in enumerate(args)]}
            if isinstance(t, torch.nn.Parameter):
                node["parameter"] = True
            if t.requires_grad:
                node["requires_grad"] = True
        if attrs:
            node["attrs"] = self._attrs(t, attrs, path)
        return node

    def _storage(self, s, path) -> dict:
        """A storage as a value (``torch.save`` keeps it): its bytes as a uint8 tensor over the same
        storage, so a storage shared with tensors is stored once and comes back shared."""
        torch = _torch()
        typed = type(s) is torch.TypedStorage
        untyped = s._untyped_storage if typed else s
        flat = torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped)
        node = {"$t": "storage", "data": self._tensor(flat, path + ("<storage>",))}
        if typed:
            node["dtype"] = str(s.dtype).replace("torch.", "")
        return node

    def _ndarray(self, a, path):
        import numpy as np

        if a.dtype.hasobject or a.dtype.kind == "V":
            raise SourceError(f"NumPy array of dtype {a.dtype} is not plain numeric data", where=_path_name(path))
        key = self._leaf_key(path)
        arr = np.ascontiguousarray(a)  # (gives a 0-d array one dimension: the shape is the array's own)
        st = NUMPY_TO_ST.get(arr.dtype.str)
        shape = [int(x) for x in a.shape]
        if st is None:  # unusual dtype (big-endian, unicode, datetime): raw bytes, dtype in the record
            st, st_shape = "U8", [arr.nbytes]
        else:
            st_shape = shape
        self.table.entries[key] = Entry(key, st, st_shape, lambda arr=arr: arr.reshape(-1).view(np.uint8),
                                        int(arr.nbytes))
        self.table.leaves[key] = {"entry": key, "kind": "numpy", "dtype": arr.dtype.str, "shape": shape}
        return {"$t": "ndarray", "key": key}

    def finish_tensors(self) -> None:
        """Group tensor leaves by storage and decide natural vs shared entries."""
        n_shared = 0
        for views in self._by_storage():
            t0 = views[0][1]
            same_geometry = all(t.dtype == t0.dtype and t.shape == t0.shape and t.stride() == t0.stride()
                                and t.storage_offset() == t0.storage_offset() for _, t in views)
            if (len(views) == 1 or same_geometry) and _natural(t0) \
                    and str(t0.dtype).replace("torch.", "") in TORCH_TO_ST:
                self._add_natural(views)
            else:
                n_shared += 1
                self._add_shared(views, n_shared)

    def _by_storage(self) -> list[list[tuple[str, Any]]]:
        """The tensor leaves grouped by the storage they view (device, address, size; each empty storage a
        group of its own), in first-seen order.

        Raises:
            SourceError: a sparse or quantized tensor among them (naming its key).
        """
        torch = _torch()
        groups: dict[tuple, list[tuple[str, Any]]] = {}
        for key, t in self._tensor_leaves:
            if t.layout != torch.strided or t.is_quantized:
                raise SourceError(f"{t.layout} / quantized tensors are not supported yet; convert to dense",
                                  where=key)
            st = t.untyped_storage()
            gid = (str(t.device), st.data_ptr(), st.nbytes()) if st.nbytes() > 0 else ("empty", key)
            groups.setdefault(gid, []).append((key, t))
        return list(groups.values())

    def _add_natural(self, views: list[tuple[str, Any]]) -> None:
        """Natural: the first tensor's bytes are its whole storage, stored as an entry of its own; the other
        views (same geometry) point at that entry."""
        key0, t0 = views[0]
        dname = str(t0.dtype).replace("torch.", "")
        self.table.entries[key0] = Entry(key0, TORCH_TO_ST[dname], [int(x) for x in t0.shape],
                                         lambda t=t0: tensor_u8(t), t0.numel() * t0.element_size())
        for i, (key, t) in enumerate(views):
            rec = {"entry": key0, "kind": "torch", "dtype": dname, "shape": [int(x) for x in t.shape],
                   **_leaf_flags(t)}
            if i > 0:
                rec["view"] = {"storage_offset": 0, "stride": [int(s) for s in t.stride()]}
                self.table.leaf_bytes[key] = lambda t=t: tensor_u8_pieces(t)
            self.table.leaves[key] = rec

    def _add_shared(self, views: list[tuple[str, Any]], n_shared: int) -> None:
        """A shared or non-contiguously viewed storage: stored once, flat (its views' one dtype, else uint8),
        as entry ``storage/<n>:<first key>``; every tensor a view of it."""
        torch = _torch()
        key0, t0 = views[0]
        nbytes_storage = t0.untyped_storage().nbytes()
        dtypes = {t.dtype for _, t in views}
        flat_dtype = t0.dtype if len(dtypes) == 1 else torch.uint8
        fname = str(flat_dtype).replace("torch.", "")
        itemsize = flat_dtype.itemsize
        if fname not in TORCH_TO_ST or nbytes_storage % itemsize:
            fname, itemsize = "uint8", 1
        entry_key = f"storage/{n_shared}:{key0}"
        self.table.entries[entry_key] = Entry(entry_key, TORCH_TO_ST[fname], [nbytes_storage // itemsize],
                                              lambda t=t0: storage_u8(t), nbytes_storage)
        for key, t in views:
            check_view_size(key, t.numel() * t.element_size(), nbytes_storage)
            rec = {"entry": entry_key, "kind": "torch", "dtype": str(t.dtype).replace("torch.", ""),
                   "shape": [int(x) for x in t.shape],
                   "view": {"storage_offset": int(t.storage_offset()), "stride": [int(s) for s in t.stride()],
                            "entry_dtype": fname}, **_leaf_flags(t)}
            self.table.leaves[key] = rec
            self.table.leaf_bytes[key] = lambda t=t: tensor_u8_pieces(t)


#: what an encoder stage returns for a value not of its kinds (None is a value: JSON null)
_UNMATCHED = object()


def _natural(t) -> bool:
    """Whether a tensor's bytes are its whole storage in C order (a natural entry). An empty tensor counts as
    contiguous whatever its strides: those are kept (as a view) unless they are the C-order ones a plain
    entry comes back with."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.numel() * t.element_size() == t.untyped_storage().nbytes()
            and (t.numel() > 0 or list(t.stride()) == c_strides(t.shape)))


def _leaf_flags(t) -> dict:
    """What a tensor leaf's record says beyond dtype/shape: a non-CPU device, requires_grad, Parameter."""
    torch = _torch()
    flags: dict = {}
    if t.device.type != "cpu":
        flags["device"] = str(t.device)
    elif getattr(t, "_ckpt_archive_device", None):  # a Checkpointer's host copy of a GPU tensor
        flags["device"] = str(t._ckpt_archive_device)
    if t.requires_grad:
        flags["requires_grad"] = True
    if isinstance(t, torch.nn.Parameter):
        flags["parameter"] = True
    bits = view_bits(t)
    if bits:
        flags["bits"] = bits
    return flags


def _probe_bytes(t, where: str) -> None:
    """Fail now, before anything is written, if a dense tensor's bytes cannot be taken the way the writer
    will take them: one element of it goes through the same path (:func:`tensor_u8`, :func:`~ckpt_archive.format.tensor_bytes.storage_u8`,
    :func:`view_bits`). A tensor kind the writer cannot read is refused at encode time, naming its path,
    instead of failing half-way through a generation."""
    torch = _torch()
    try:
        view_bits(t)
        if t.numel() > 0:
            one = torch.as_strided(t.detach(), (1,), (1,), t.storage_offset())
            tensor_u8(one)
        if t.untyped_storage().nbytes() > 0 and t.device.type == "cpu":
            storage_u8(t)
    except SourceError as exc:
        exc.where = where
        raise
    except (RuntimeError, TypeError, ValueError) as exc:
        raise SourceError(f"the bytes of this {t.dtype} tensor cannot be read for archiving: {exc}",
                          where=where, hint="convert it to a plain dense tensor (t.detach().clone()) "
                                            "before saving") from None


def encode(state: Any, *, allow=None, encoder: type | None = None) -> tuple[Any, TensorTable]:
    """Encode a nested state so that :func:`decode` gives back the same types, values, order and aliasing.

    Args:
        state: anything ``torch.load(weights_only=True)`` of the installed torch accepts (see
            :mod:`ckpt_archive.format.allowlist` and docs/FORMAT.md, "What round-trips"): dict /
            OrderedDict / Counter / list / tuple / set, int (any size) / float (incl. inf, nan) / bool /
            complex / str / bytes / bytearray / None, torch.Size / dtype / device / layout / qscheme,
            tensors of every kind (dense of any dtype and device, sparse, quantized, nested, meta;
            Parameters; views and shared storages; Python attributes), storages; plus NumPy arrays,
            scalars and dtypes.
        allow: names (``"argparse.Namespace"``) or classes of admitted plain-data classes; default: those
            admitted by :func:`ckpt_archive.format.allowlist.allowing` in this context.
        encoder: an ``Encoder`` subclass (:mod:`ckpt_archive.format.pt_encode`: tensors read without torch).

    Returns:
        (tree, table): ``tree`` is strict-JSON-able (``json.dumps(tree, allow_nan=False)`` works);
        ``table`` holds the tensor entries to store and a record per tensor leaf.

    Raises:
        SourceError: a value that cannot round-trip exactly (a subclass of a builtin container, a
            custom class not admitted, a tensor subclass, an object array), naming its path, its type
            and what to do. Nothing is ever stored as a lookalike of another type.
    """
    enc = (encoder or Encoder)(allow)
    enc.count_shared(state)
    from ckpt_archive.format.jsonio import MAX_DEPTH, depth_exceeds

    too_deep = SourceError(f"the state is nested too deeply to archive: its encoded tree would be more than "
                           f"{MAX_DEPTH - 2} JSON levels deep, where readers stop (containers inside containers, "
                           f"a few hundred levels); flatten that part of the state", where="state")
    try:
        tree = enc.enc(state, ())
    except RecursionError:
        raise too_deep from None
    if depth_exceeds(tree, MAX_DEPTH - 2):  # refused here, before a generation is claimed, not by the trial reload
        raise too_deep
    enc.finish_tensors()
    return tree, enc.table


def encode_value(value: Any) -> Any:
    """Encode a tensor-free value (config, metrics) to strict JSON with the same tags."""
    enc = Encoder(())
    tree = enc.enc(value, ())
    if enc._tensor_leaves or enc.table.entries:
        names = ", ".join(key for key, _ in enc._tensor_leaves[:5])
        raise SourceError("tensors are not allowed here (config/metrics must be plain values)"
                          + (f": {names}" if names else ""),
                          hint="pass numbers, e.g. loss.item() instead of loss" if names else None)
    return tree


def _torch_attr(name: str, kind: str):
    """``torch.<name>`` when it is a ``kind`` (dtype / layout), never any other attribute of torch."""
    torch = _torch()
    obj = torch.__dict__.get(name) if isinstance(name, str) else None
    want = {"dtype": torch.dtype, "layout": torch.layout}[kind]
    if type(obj) is not want:
        raise FormatError(f"unknown torch {kind} {name!r}")
    return obj


class _ReaderError(Exception):
    """An exception raised by ``decode``'s tensor getter, carried through unchanged (a store or integrity
    error of the reader is not a malformed tree node)."""

    def __init__(self, exc: BaseException):
        super().__init__(exc)
        self.exc = exc


def _np_dtype(node: dict) -> Any:
    import numpy as np

    return np.dtype(node["v"])


#: Tags whose node decodes without decoding anything inside it: tag -> ``f(node)``.
_SIMPLE_TAGS: dict[str, Callable[[dict], Any]] = {
    "str": str_from_node,  # a str with lone surrogates (see Encoder._enc)
    "bytes": lambda node: base64.b64decode(node["b64"]),
    "bytearray": lambda node: bytearray(base64.b64decode(node["b64"])),
    "npdtype": _np_dtype,
    "dtype": lambda node: _torch_attr(node["v"], "dtype"),
    "layout": lambda node: _torch_attr(node["v"], "layout"),
    "size": lambda node: _torch().Size(node["v"]),
    "device": lambda node: _torch().device(node["v"]),
    "global": lambda node: resolve_global(node["v"]),
}


def _leaf_node(node: dict, t: str, dec: Callable[[Any], Any], tensor: Callable[[str], Any], build: bool) -> Any:
    """:func:`decode` of a tagged node that is not a container (a tensor, storage, scalar, torch or NumPy
    type, global or object); ``dec`` decodes its parts, ``tensor`` gives a leaf's tensor.

    Raises:
        MalformedTree: an unknown tag or a malformed node. FormatError: a global or class not admitted.
    """
    if t in ("tensor", "ndarray"):
        obj = tensor(node["key"])
        if node.get("attrs") and obj is not None:
            obj.__dict__.update({k: dec(v) for k, v in node["attrs"].items()})
        return obj
    if t == "rebuild":
        return rebuild(node, dec, build)
    if t == "storage":
        data = dec(node["data"])
        if data is None:
            return None
        if holds_stub(data):  # left undecoded by its reader (the policy audit): so is its storage
            return data
        storage = data.untyped_storage()
        if "dtype" in node:
            import torch

            return torch.TypedStorage(wrap_storage=storage, dtype=_torch_attr(node["dtype"], "dtype"),
                                      _internal=True)
        return storage
    simple = _SIMPLE_TAGS.get(t)
    if simple is not None:
        return simple(node)
    if t == "npscalar":
        import numpy as np

        raw, dtype = bytes.fromhex(node["hex"]), np.dtype(node["dtype"])
        if dtype.hasobject or len(raw) != dtype.itemsize:
            raise MalformedTree(f"malformed npscalar node: {len(raw)} bytes for dtype {dtype.str!r}")
        return np.frombuffer(raw, dtype=dtype)[0]
    if t == "object":
        state = node.get("state")
        if not isinstance(state, dict) or "$t" in state:
            raise MalformedTree(f"malformed object node for {node.get('class')!r}")
        values = {k: dec(v) for k, v in state.items()}
        if not build:
            return None
        cls = decode_class(str(node.get("class")))
        obj = object.__new__(cls)
        obj.__dict__.update(values)
        return obj
    raise MalformedTree(f"unknown tree tag {t!r}")


def decode(tree: Any, get_tensor: Callable[[str], Any], *, objects: str = "build",
           where: str | None = None) -> Any:
    """Rebuild the nested state from an encoded tree.

    Args:
        tree: the output of :func:`encode` (after a JSON round trip).
        get_tensor: returns the tensor (or ndarray) for a leaf key.
        objects: ``"build"`` rebuilds admitted plain-data objects (classes admitted with
            :func:`ckpt_archive.format.allowlist.allowing`, or built in such as
            ``argparse.Namespace``); ``"check"`` only checks their shape (trial reload: the tree is
            checked, not used), and builds no tensor from a rebuild function either.
        where: the tree member's name, for the errors.

    Raises:
        MalformedTree (a FormatError, exit 1): an unknown tag or a malformed node -- whatever Python,
            NumPy or torch raise while rebuilding a node from a hostile tree (a bad number, a dtype that
            cannot hold a scalar, a device index out of range, a rebuild whose geometry does not fit its
            storage) is reported so, never as an internal error.
        FormatError (exit 2): a name outside torch's allowlist, a plain-data class the reader did not
            admit (names the ``--allow`` that would), a reference to a shared value outside the part read.
        Whatever ``get_tensor`` raises, unchanged.
    """
    build = objects == "build"
    shared: dict[int, Any] = {}

    def tensor(key):
        try:
            return get_tensor(key)
        except Exception as exc:  # noqa: BLE001 - the reader's own error, not the tree's
            raise _ReaderError(exc) from None

    def items(node):
        its = node.get("items")
        if not isinstance(its, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in its):
            raise MalformedTree(f"malformed {node.get('$t')} node")
        return [(_hashable(dec(k)), dec(v)) for k, v in its]

    def shared_node(node):  # a container reached more than once: decoded once, the same object after
        n = node.get("id")
        if type(n) is not int or n in shared:
            raise MalformedTree(f"malformed shared node (id {n!r})")
        shared[n] = value = dec(node.get("v"))
        return value

    def ref_node(node):
        n = node.get("id")
        if type(n) is not int or n not in shared:
            raise FormatError(f"the state tree refers to shared value {n!r} before (or outside) it; read the "
                              f"whole state, or the part that holds its first occurrence")
        return shared[n]

    def ordered(node):  # an OrderedDict or a Counter, with the attributes set on it
        obj = collections.OrderedDict() if node["$t"] == "odict" else collections.Counter()
        for k, v in items(node):
            obj[k] = v
        for name, val in (node.get("attrs") or {}).items():
            setattr(obj, name, dec(val))
        return obj

    containers = {
        "shared": shared_node, "ref": ref_node, "odict": ordered, "counter": ordered,
        "int": lambda node: int(node["v"]), "float": lambda node: float(node["v"]),
        "complex": lambda node: complex(float(dec(node["re"])), float(dec(node["im"]))),
        "tuple": lambda node: tuple(dec(v) for v in node["v"]),
        "set": lambda node: {_hashable(dec(v)) for v in node["v"]},
        "dict": lambda node: dict(items(node)),
    }

    def dec(node):
        if node is None or isinstance(node, (str, bool, int, float)):
            return node
        if isinstance(node, list):
            if len(node) > 16 and _JSON_ATOMS.issuperset(map(type, node)):
                return list(node)  # every element decodes to itself (a sampler's permutation)
            return [dec(v) for v in node]
        if not isinstance(node, dict):
            raise MalformedTree(f"malformed tree node {node!r}")
        t = node.get("$t")
        if t is None:
            return {k: dec(v) for k, v in node.items()}
        handler = containers.get(t) if isinstance(t, str) else None
        if handler is not None:
            return handler(node)
        return _leaf_node(node, t, dec, tensor, build)

    try:
        return dec(tree)
    except _ReaderError as exc:
        raise exc.exc from None
    except CkptArchiveError as exc:
        if exc.where is None:
            exc.where = where
        raise
    except Exception as exc:  # noqa: BLE001 - [issue 17, break test 4] a hand-made node: any error
        # (ValueError from int("0x10"), RuntimeError from torch.device or a rebuild, OverflowError,
        # RecursionError, MemoryError) is the tree's fault, reported as damaged, never as a bug
        raise MalformedTree(f"malformed state tree node ({type(exc).__name__}: {first_line(exc, 300)})",
                            where=where) from None


def _hashable(k):
    if isinstance(k, list):
        return tuple(_hashable(x) for x in k)
    return k


__all__ = ["MAX_SAFE_INT", "Entry", "TensorTable", "Encoder", "encode", "encode_value", "decode"]
