"""Nested training state <-> (strict-JSON tree, tensor table).

Why one long module (~730 lines, over the ~600 guide): encode and decode are the two halves of one
contract (docs/FORMAT.md "State tree") and must change together, tag by tag; splitting them apart made
every new tag a two-file edit that could drift. Walking an encoded tree (nodes, tensor references,
shared/ref aliasing) is the readers' concern and lives in :mod:`ckpt_archive.format.tree_walk`; the next
split, when this grows again, is the view bits into a module of their own.

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

MAX_SAFE_INT = 2**53

# torch dtype name -> safetensors dtype string (safetensors spec, "dtype" field).
TORCH_TO_ST = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}
# numpy dtype.str (native little-endian forms) -> safetensors dtype string
NUMPY_TO_ST = {
    "<f8": "F64", "<f4": "F32", "<f2": "F16", "<i8": "I64", "<i4": "I32", "<i2": "I16", "|i1": "I8",
    "|u1": "U8", "|b1": "BOOL", "<u2": "U16", "<u4": "U32", "<u8": "U64", "<c8": "C64",
}
FLOAT_ST = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "C64": 4}


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
    (in elements), for non-CPU tensors ``device``; ``leaf_bytes`` gives view leaves' contiguous bytes
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


#: The lazy view bits ``torch.save`` keeps (``torch._utils.get_tensor_metadata``) and this format records.
VIEW_BITS = ("conj", "neg")


def view_bits(t) -> dict:
    """The lazy view bits of a dense tensor that ``torch.save`` keeps: ``{"conj": True}`` for an unresolved
    conjugate view, ``{"neg": True}`` for a negative view (``torch._utils.get_tensor_metadata``).

    Raises:
        SourceError: torch reports a bit this format does not know (a newer torch): refused, not dropped.
    """
    torch = _torch()
    bits = {k: bool(v) for k, v in torch._utils.get_tensor_metadata(t).items() if v}
    unknown = sorted(set(bits) - set(VIEW_BITS))
    if unknown:
        raise SourceError(f"tensor carries view metadata {unknown} that this format cannot record",
                          hint="resolve it before saving (e.g. t.clone())")
    return bits


def empty_tensor(dtype, device=None):
    """A 0-element tensor of ``dtype`` for ``.set_()`` that allocates and fills nothing.

    ``torch.empty(0, dtype=...)`` runs the deterministic fill when a training script turned on
    ``torch.use_deterministic_algorithms(True)``, and that fill has no kernel for ``uint1``-``uint7``,
    ``int1``-``int7`` (``"fill_empty_deterministic_" not implemented for 'UInt4'``): a pack or restore in such
    a process crashed. A view of an empty ``uint8`` tensor runs no kernel.
    """
    torch = _torch()
    base = torch.empty(0, dtype=torch.uint8, device=device)
    return base if dtype == torch.uint8 else base.view(dtype)


def physical(t):
    """``t`` without its lazy conj/neg bits: the same storage, offset, shape and strides, i.e. the bytes
    as they lie in memory (what ``torch.save`` writes for such a view). ``t`` itself when it has none."""
    torch = _torch()
    if not (t.is_conj() or t.is_neg()):
        return t
    with torch.no_grad():
        return empty_tensor(t.dtype, t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def apply_view_bits(t, bits: dict):
    """Put recorded conj/neg bits back on a tensor built from the physical bytes (a new alias of it, as
    ``torch.load`` gives: ``is_conj()`` / ``is_neg()`` true, same storage).

    Raises:
        FormatError: a bit name this reader does not know (hostile or newer archive).
    """
    if not bits:
        return t
    if not isinstance(bits, dict) or any(k not in VIEW_BITS or v is not True for k, v in bits.items()):
        raise FormatError(f"unknown tensor view bits {bits!r}")
    torch = _torch()
    t = t.detach()  # a new alias: the shared base tensor keeps no bits
    torch._utils.set_tensor_metadata(t, dict(bits))
    return t


def _tensor_u8(t):
    """Contiguous CPU bytes of a tensor as a 1-D uint8 NumPy array (no copy when already contiguous).

    A conj/neg view gives its physical bytes (:func:`physical`), as ``torch.save`` stores them."""
    torch = _torch()
    t = physical(t.detach())
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        import numpy as np

        return np.zeros(0, dtype=np.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).view(torch.uint8).numpy()


def _storage_u8(t):
    """The whole untyped storage under ``t`` as a 1-D uint8 NumPy array (CPU)."""
    torch = _torch()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.numpy()


def _float(v: float):
    if math.isfinite(v):
        return v
    return {"$t": "float", "v": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}


def _plain_json_list(obj: list) -> bool:
    """Whether every element of a list is its own JSON encoding: all safe-range ints, all finite floats or
    all UTF-8 str (what :meth:`_Encoder._enc` would return unchanged, one element at a time)."""
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


class _Encoder:
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
        """Leaf types counted for sharing; torch's only once imported (none of its objects exist before)."""
        import numpy as np

        torch = sys.modules.get("torch")
        return (np.ndarray, bytearray) + ((torch.Tensor, torch.UntypedStorage, torch.TypedStorage) if torch else ())

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
        """Encode one value; every type is matched exactly (a subclass is never stored as its base)."""
        torch = sys.modules.get("torch")  # None: no torch object can exist (see _leaf_types)
        import numpy as np

        tp = type(obj)
        if tp is str and not utf8_ok(obj):
            # lone surrogates (a non-UTF-8 file name through os.fsdecode): JSON text cannot carry them
            return str_node(obj)
        if obj is None or tp is str or tp is bool:
            return obj
        if isinstance(obj, np.generic):  # before float: np.float64 subclasses float
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
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if tp is np.ndarray:
            return self._ndarray(obj, path)
        if isinstance(obj, np.dtype):
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
        cname = class_name(tp)
        if cname in self.allow:
            return {"$t": "object", "class": cname,
                    "state": {k: self.enc(v, path + (k,)) for k, v in _plain_state(obj, path).items()}}
        raise refusal(_path_name(path), obj)

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
        torch = _torch()
        groups: dict[tuple, list[tuple[str, Any]]] = {}
        order: list[tuple] = []
        for key, t in self._tensor_leaves:
            if t.layout != torch.strided or t.is_quantized:
                raise SourceError(f"{t.layout} / quantized tensors are not supported yet; convert to dense",
                                  where=key)
            st = t.untyped_storage()
            gid = (str(t.device), st.data_ptr(), st.nbytes()) if st.nbytes() > 0 else ("empty", key)
            if gid not in groups:
                groups[gid] = []
                order.append(gid)
            groups[gid].append((key, t))
        n_shared = 0
        for gid in order:
            views = groups[gid]
            key0, t0 = views[0]
            nbytes_storage = t0.untyped_storage().nbytes()
            dname = str(t0.dtype).replace("torch.", "")

            def natural(t):
                # an empty tensor counts as contiguous whatever its strides: those are kept (as a view)
                # unless they are the C-order ones a plain entry comes back with
                return (t.is_contiguous() and t.storage_offset() == 0
                        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
                        and (t.numel() > 0 or list(t.stride()) == _c_strides(t.shape)))

            same_geometry = all(t.dtype == t0.dtype and t.shape == t0.shape and t.stride() == t0.stride()
                                and t.storage_offset() == t0.storage_offset() for _, t in views)
            if (len(views) == 1 or same_geometry) and natural(t0) \
                    and dname in TORCH_TO_ST:
                self.table.entries[key0] = Entry(key0, TORCH_TO_ST[dname], [int(x) for x in t0.shape],
                                                 lambda t=t0: _tensor_u8(t), t0.numel() * t0.element_size())
                for i, (key, t) in enumerate(views):
                    rec = {"entry": key0, "kind": "torch", "dtype": dname, "shape": [int(x) for x in t.shape],
                           **_leaf_flags(t)}
                    if i > 0:
                        rec["view"] = {"storage_offset": 0, "stride": [int(s) for s in t.stride()]}
                        self.table.leaf_bytes[key] = lambda t=t: _tensor_u8(t)
                    self.table.leaves[key] = rec
                continue
            # A shared or non-contiguously viewed storage: store it once, flat.
            n_shared += 1
            dtypes = {t.dtype for _, t in views}
            flat_dtype = t0.dtype if len(dtypes) == 1 else torch.uint8
            fname = str(flat_dtype).replace("torch.", "")
            itemsize = flat_dtype.itemsize
            if fname not in TORCH_TO_ST or nbytes_storage % itemsize:
                fname, itemsize = "uint8", 1
            entry_key = f"storage/{n_shared}:{key0}"
            self.table.entries[entry_key] = Entry(entry_key, TORCH_TO_ST[fname], [nbytes_storage // itemsize],
                                                  lambda t=t0: _storage_u8(t), nbytes_storage)
            for key, t in views:
                rec = {"entry": entry_key, "kind": "torch", "dtype": str(t.dtype).replace("torch.", ""),
                       "shape": [int(x) for x in t.shape],
                       "view": {"storage_offset": int(t.storage_offset()), "stride": [int(s) for s in t.stride()],
                                "entry_dtype": fname}, **_leaf_flags(t)}
                self.table.leaves[key] = rec
                self.table.leaf_bytes[key] = lambda t=t: _tensor_u8(t)


def _c_strides(shape) -> list[int]:
    """The strides, in elements, of a C-contiguous tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed([int(x) for x in shape]):
        out.append(acc)
        acc *= max(n, 1)
    return out[::-1]


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
    will take them: one element of it goes through the same path (:func:`_tensor_u8`, :func:`_storage_u8`,
    :func:`view_bits`). A tensor kind the writer cannot read is refused at encode time, naming its path,
    instead of failing half-way through a generation."""
    torch = _torch()
    try:
        view_bits(t)
        if t.numel() > 0:
            one = torch.as_strided(t.detach(), (1,), (1,), t.storage_offset())
            _tensor_u8(one)
        if t.untyped_storage().nbytes() > 0 and t.device.type == "cpu":
            _storage_u8(t)
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
        encoder: an ``_Encoder`` subclass (:mod:`ckpt_archive.format.pt_encode`: tensors read without torch).

    Returns:
        (tree, table): ``tree`` is strict-JSON-able (``json.dumps(tree, allow_nan=False)`` works);
        ``table`` holds the tensor entries to store and a record per tensor leaf.

    Raises:
        SourceError: a value that cannot round-trip exactly (a subclass of a builtin container, a
            custom class not admitted, a tensor subclass, an object array), naming its path, its type
            and what to do. Nothing is ever stored as a lookalike of another type.
    """
    enc = (encoder or _Encoder)(allow)
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
    enc = _Encoder(())
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
        if t == "shared":  # a container reached more than once: decoded once, the same object after
            n = node.get("id")
            if type(n) is not int or n in shared:
                raise MalformedTree(f"malformed shared node (id {n!r})")
            shared[n] = value = dec(node.get("v"))
            return value
        if t == "ref":
            n = node.get("id")
            if type(n) is not int or n not in shared:
                raise FormatError(f"the state tree refers to shared value {n!r} before (or outside) it; read the "
                                  f"whole state, or the part that holds its first occurrence")
            return shared[n]
        if t == "int":
            return int(node["v"])
        if t == "float":
            return float(node["v"])
        if t == "complex":
            return complex(float(dec(node["re"])), float(dec(node["im"])))
        if t == "tuple":
            return tuple(dec(v) for v in node["v"])
        if t == "set":
            return {_hashable(dec(v)) for v in node["v"]}
        if t == "dict":
            return dict(items(node))
        if t in ("odict", "counter"):
            cls = collections.OrderedDict if t == "odict" else collections.Counter
            obj = cls()
            for k, v in items(node):
                obj[k] = v
            for name, val in (node.get("attrs") or {}).items():
                setattr(obj, name, dec(val))
            return obj
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
        if t == "str":  # a str with lone surrogates (see _Encoder._enc)
            return str_from_node(node)
        if t == "bytes":
            return base64.b64decode(node["b64"])
        if t == "bytearray":
            return bytearray(base64.b64decode(node["b64"]))
        if t == "npscalar":
            import numpy as np

            raw, dtype = bytes.fromhex(node["hex"]), np.dtype(node["dtype"])
            if dtype.hasobject or len(raw) != dtype.itemsize:
                raise MalformedTree(f"malformed npscalar node: {len(raw)} bytes for dtype {dtype.str!r}")
            return np.frombuffer(raw, dtype=dtype)[0]
        if t == "npdtype":
            import numpy as np

            return np.dtype(node["v"])
        if t == "dtype":
            return _torch_attr(node["v"], "dtype")
        if t == "layout":
            return _torch_attr(node["v"], "layout")
        if t == "size":
            return _torch().Size(node["v"])
        if t == "device":
            return _torch().device(node["v"])
        if t == "global":
            return resolve_global(node["v"])
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


def torch_dtype(name: str):
    """torch dtype from its name (``"bfloat16"``)."""
    torch = _torch()
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise FormatError(f"unknown torch dtype {name!r}")
    return dt
