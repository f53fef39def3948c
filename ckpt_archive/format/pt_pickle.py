"""[issue 29] A ``torch.save`` file read without torch: a restricted pickle *reader* that executes nothing.

``import torch`` costs about a second of CPU before ``torch.load`` reads a byte, and most checkpoints need
none of it: their pickle (``<archive>/data.pkl``) holds dicts, lists, tuples, numbers, strings,
``collections.OrderedDict`` (a ``state_dict`` with its ``_metadata``) and dense tensors rebuilt by
``torch._utils._rebuild_tensor_v2`` from storages whose bytes lie, uncompressed, in the zip's
``<archive>/data/<key>`` records (format/exact_bytes.py reads them already).

:func:`read` interprets that pickle with a small stack machine that accepts **only** what it can prove
gives the same object graph as ``torch.load(path, weights_only=True, map_location="cpu")``:

* opcodes: the protocol-2 subset torch's own weights-only unpickler accepts
  (``torch/_weights_only_unpickler.py``), minus those this reader does not need (``NEWOBJ``,
  ``EMPTY_SET``, ``SHORT_BINSTRING``);
* globals: exactly ``collections.OrderedDict`` (called with no arguments, then filled; ``BUILD`` with a
  dict sets its attributes, as torch does), ``torch._utils._rebuild_tensor_v2`` (a dense tensor: no
  ``requires_grad``, no backward hooks, no conj/neg metadata, geometry inside its storage) and the
  twelve classic storage classes (``torch.FloatStorage``, ... of the dtypes :data:`STORAGE_DTYPES`
  names) inside a ``("storage", <class>, key, location, numel)`` persistent id whose record exists and
  holds exactly ``numel`` elements;
* a little-endian file (its ``byteorder`` record, or none) on a little-endian machine; a file-format
  ``version`` record of 1-3; no TorchScript (``constants.pkl``); record names without duplicates.

Nothing is ever called, imported or looked up by name: a global is a token, the only functions "called"
are the reader's own constructors for the three globals above. Anything else -- another global (NumPy,
``torch.Size``, a ``Parameter``, an admitted plain-data class), another opcode, a malformed stack, a
storage key reused with another type, a view outside its storage -- raises :class:`NotSimple`, and the
caller falls back to ``torch.load(weights_only=True)``, whose verdict (and refusal) stands. So the reader
can only ever accept less than torch accepts, never more.

Tensors come back as :class:`PtTensor` (a view described by storage, offset, shape and stride; its bytes
stay in the file, mapped read-only on demand). :mod:`ckpt_archive.format.pt_encode` encodes such a state
into the same tree and tensor table as the tensors ``torch.load`` would have given
(``tests/test_torch_free.py`` proves it for every kind of state the suite packs).
"""
from __future__ import annotations

import math
import mmap
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

#: Classic storage classes (``torch.storage._dtype_to_storage_type_map``) -> torch dtype name.
STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
}
#: Bytes per element of each dtype above.
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
_FLOATS = frozenset({"float64", "float32", "float16", "bfloat16"})
_SCALAR = {"float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h",
           "int8": "<b", "uint8": "<B"}


class NotSimple(Exception):
    """The file holds something this reader does not prove equal to ``torch.load``'s result: fall back."""


class _Device:
    type = "cpu"

    def __str__(self) -> str:
        return "cpu"


_CPU = _Device()


class PtFile:
    """The source file, mapped read-only once (tensor bytes are read from the map, never copied whole)."""

    def __init__(self, path: Path):
        from ckpt_archive.format.exact_bytes import file_identity

        self.path = Path(path)
        #: the file as it was when mapped (:func:`~ckpt_archive.format.exact_bytes.file_identity`): the one a
        #: scan of the same identity read, whose range fingerprints are then the entries' (repo/writer.py)
        self.identity = file_identity(self.path)
        with open(self.path, "rb") as fh:
            size = fh.seek(0, 2)
            self.map = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) if size else b""

    def view(self, offset: int, nbytes: int):
        """A read-only uint8 NumPy view of ``nbytes`` at ``offset`` (file pages, not anonymous memory)."""
        import numpy as np

        if nbytes == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(self.map, dtype=np.uint8, count=nbytes, offset=offset)


class PtStorage:
    """One ``data/<key>`` record: its dtype, element count and where its bytes start in the file."""

    __slots__ = ("key", "dtype", "numel", "offset", "file")

    def __init__(self, key: str, dtype: str, numel: int, offset: int, file: PtFile):
        self.key, self.dtype, self.numel, self.offset, self.file = key, dtype, numel, offset, file

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


class PtTensor:
    """A dense CPU tensor of a ``torch.save`` file, not loaded: a view of a :class:`PtStorage`.

    Quacks like the few tensor attributes readers of a source state use before encoding (the progress
    and metrics finders: ``numel()``, ``item()``, ``is_floating_point()``, ``layout``, ``device``, ...).
    """

    __slots__ = ("storage", "offset", "shape", "stride")
    is_sparse = False
    is_quantized = False
    is_nested = False
    requires_grad = False
    layout = "torch.strided"
    device = _CPU

    def __init__(self, storage: PtStorage, offset: int, shape: tuple, stride: tuple):
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def element_size(self) -> int:
        return ITEMSIZE[self.storage.dtype]

    def is_floating_point(self) -> bool:
        return self.storage.dtype in _FLOATS

    def is_contiguous(self) -> bool:
        """torch's rule (``c10::TensorImpl::compute_contiguous``): dims of size 1 are skipped."""
        if self.numel() == 0:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1:
                if stride != expected:
                    return False
                expected *= size
        return True

    def item(self):
        """The one element as a Python number, as ``Tensor.item()`` gives it.

        Raises:
            ValueError: the tensor does not hold exactly one element.
        """
        if self.numel() != 1:
            raise ValueError("only one element tensors can be converted to Python scalars")
        size = ITEMSIZE[self.storage.dtype]
        at = self.storage.offset + self.offset * size
        raw = bytes(self.storage.file.map[at:at + size])
        d = self.storage.dtype
        if d == "bfloat16":
            return struct.unpack("<f", b"\0\0" + raw)[0]
        if d == "bool":
            return raw != b"\0"
        if d in ("complex64", "complex128"):
            re, im = struct.unpack("<ff" if d == "complex64" else "<dd", raw)
            return complex(re, im)
        return struct.unpack(_SCALAR[d], raw)[0]

    def contiguous_bytes(self):
        """The tensor's elements in C order as a 1-D uint8 NumPy array (what ``torch.save``'s bytes of
        ``t.contiguous()`` are); a view of the file where they already lie so."""
        import numpy as np

        st, size = self.storage, ITEMSIZE[self.storage.dtype]
        n = self.numel()
        if n == 0:
            return np.zeros(0, dtype=np.uint8)
        if self.is_contiguous():
            return st.file.view(st.offset + self.offset * size, n * size)
        elems = np.frombuffer(st.file.map, dtype=np.dtype((np.void, size)), count=st.numel, offset=st.offset)
        view = np.lib.stride_tricks.as_strided(elems[self.offset:], shape=self.shape,
                                               strides=[s * size for s in self.stride], writeable=False)
        return np.ascontiguousarray(view).reshape(-1).view(np.uint8)

    def __repr__(self) -> str:
        return f"PtTensor(dtype={self.dtype}, shape={list(self.shape)}, storage={self.storage.key})"


class _Global:
    """A ``GLOBAL`` opcode's name: a token, never resolved to an object."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


_ODICT = "collections\nOrderedDict"
_REBUILD = "torch._utils\n_rebuild_tensor_v2"
_MAX_VERSION = 3


def read(path: Path) -> tuple[Any, PtFile]:
    """The object ``torch.load(path, weights_only=True, map_location="cpu")`` gives, with
    :class:`PtTensor` in place of tensors -- or :class:`NotSimple` (see the module docstring).

    Returns:
        ``(state, file)``; ``file`` maps the tensors' bytes.

    Raises:
        NotSimple: anything this reader does not prove equal to torch's result (the caller falls back to
            torch.load). Never any other exception for a file's content.
    """
    try:
        return _read(Path(path))
    except NotSimple:
        raise
    except Exception as exc:  # noqa: BLE001 - any surprise in a hostile file: torch.load decides
        raise NotSimple(f"{type(exc).__name__}: {exc}") from None


def _read(path: Path) -> tuple[Any, PtFile]:
    from ckpt_archive.format.exact_bytes import zip_records

    if sys.byteorder != "little" or not zipfile.is_zipfile(path):
        raise NotSimple("not a zip-format torch.save file on a little-endian machine")
    records = zip_records(path)
    names = [r[3] for r in records]
    if not names or len(set(names)) != len(names):
        raise NotSimple("empty zip, or duplicate record names")
    prefix = names[0].split("/", 1)[0]
    by_name = {r[3]: r for r in records}
    with zipfile.ZipFile(path) as zf:
        def small(name: str) -> bytes | None:
            rec = by_name.get(f"{prefix}/{name}")
            if rec is None:
                return None
            if rec[1] > 1 << 16:
                raise NotSimple(f"record {name} is unexpectedly large")
            return zf.read(f"{prefix}/{name}")

        if f"{prefix}/constants.pkl" in by_name:
            raise NotSimple("a TorchScript archive")
        version = small("version") if f"{prefix}/version" in by_name else small(".data/version")
        if version is None or version.strip() not in {str(v).encode() for v in range(1, _MAX_VERSION + 1)}:
            raise NotSimple(f"file format version {version!r}")
        order = small("byteorder")
        if order not in (None, b"little"):
            raise NotSimple(f"byte order {order!r}")
        pkl = by_name.get(f"{prefix}/data.pkl")
        if pkl is None:
            raise NotSimple("no data.pkl")
        data = zf.read(pkl[3])
    storages = {name[len(prefix) + 6:]: (start, length) for start, length, _, name, stored in records
                if stored and name.startswith(f"{prefix}/data/")}
    file = PtFile(path)
    return _Machine(data, storages, file).run(), file


class _Machine:
    """The stack machine (``pickle.Unpickler.load``'s loop, restricted; see the module docstring)."""

    def __init__(self, data: bytes, storages: dict, file: PtFile):
        self.data = data
        self.pos = 0
        self.storages = storages
        self.file = file
        self.loaded: dict[str, PtStorage] = {}
        self.tainted: set[int] = set()  # ids of tuples holding a global token (a persistent id's)
        self.keep: list = []            # keeps tainted tuples alive, so their ids stay theirs

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise NotSimple("pickle ends early")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos)
        if end < 0:
            raise NotSimple("pickle ends early")
        b = self.data[self.pos:end]
        self.pos = end + 1
        return b.decode("utf-8")

    def clean(self, x: Any) -> Any:
        """``x`` unless it is a global token or a tuple holding one (those may go nowhere else)."""
        if type(x) is _Global or (type(x) is tuple and id(x) in self.tainted):
            raise NotSimple("a global used as a value")
        return x

    def run(self) -> Any:
        stack: list = []
        meta: list = []
        memo: dict[int, Any] = {}
        unpack = struct.unpack
        while True:
            op = self.take(1)[0]
            if op == 0x80:  # PROTO
                self.take(1)
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x28:  # MARK
                meta.append(stack)
                stack = []
            elif op == 0x74:  # TUPLE
                items = stack
                stack = meta.pop()
                stack.append(self.tuple(items))
            elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
                n = op - 0x84
                if len(stack) < n:
                    raise NotSimple("stack underflow")
                items = stack[-n:]
                del stack[-n:]
                stack.append(self.tuple(items))
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x4A:  # BININT
                stack.append(unpack("<i", self.take(4))[0])
            elif op == 0x4B:  # BININT1
                stack.append(self.take(1)[0])
            elif op == 0x4D:  # BININT2
                stack.append(unpack("<H", self.take(2))[0])
            elif op == 0x8A:  # LONG1
                n = self.take(1)[0]
                stack.append(int.from_bytes(self.take(n), "little", signed=True))
            elif op == 0x47:  # BINFLOAT
                stack.append(unpack(">d", self.take(8))[0])
            elif op == 0x58:  # BINUNICODE (torch decodes with surrogatepass)
                n = unpack("<I", self.take(4))[0]
                stack.append(str(self.take(n), "utf-8", "surrogatepass"))
            elif op in (0x71, 0x72):  # BINPUT, LONG_BINPUT
                i = self.take(1)[0] if op == 0x71 else unpack("<I", self.take(4))[0]
                memo[i] = stack[-1]
            elif op in (0x68, 0x6A):  # BINGET, LONG_BINGET
                i = self.take(1)[0] if op == 0x68 else unpack("<I", self.take(4))[0]
                if i not in memo:
                    raise NotSimple("memo key missing")
                stack.append(memo[i])
            elif op == 0x61:  # APPEND
                item = self.clean(stack.pop())
                if type(stack[-1]) is not list:
                    raise NotSimple("APPEND to a non-list")
                stack[-1].append(item)
            elif op == 0x65:  # APPENDS
                items = [self.clean(x) for x in stack]
                stack = meta.pop()
                if type(stack[-1]) is not list:
                    raise NotSimple("APPENDS to a non-list")
                stack[-1].extend(items)
            elif op == 0x73:  # SETITEM
                v, k = self.clean(stack.pop()), self.clean(stack.pop())
                self.setitems(stack[-1], [k, v])
            elif op == 0x75:  # SETITEMS
                items = [self.clean(x) for x in stack]
                stack = meta.pop()
                self.setitems(stack[-1], items)
            elif op == 0x63:  # GLOBAL
                module, name = self.line(), self.line()
                stack.append(_Global(f"{module}\n{name}"))
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                stack[-1] = self.reduce(stack[-1], args)
            elif op == 0x62:  # BUILD
                state = self.clean(stack.pop())
                inst = stack[-1]
                if type(inst) is not _OrderedDict or type(state) is not dict:
                    raise NotSimple("BUILD of something other than an OrderedDict's attributes")
                inst.__dict__.update(state)
            elif op == 0x51:  # BINPERSID
                stack.append(self.storage(stack.pop()))
            elif op == 0x2E:  # STOP
                return self.clean(stack.pop())
            else:
                raise NotSimple(f"opcode {op:#04x}")

    def tuple(self, items: list) -> tuple:
        t = tuple(items)
        if any(type(x) is _Global or (type(x) is tuple and id(x) in self.tainted) for x in items):
            self.tainted.add(id(t))
            self.keep.append(t)
        return t

    @staticmethod
    def setitems(target: Any, items: list) -> None:
        if type(target) not in (dict, _OrderedDict) or len(items) % 2:
            raise NotSimple("SETITEMS on a non-dict, or an odd item count")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]  # an unhashable key raises TypeError: NotSimple (read())

    def reduce(self, func: Any, args: Any) -> Any:
        if type(func) is not _Global or type(args) is not tuple:
            raise NotSimple("REDUCE of something other than an allowlisted global")
        for a in args:
            self.clean(a)
        if func.name == _ODICT:
            if args != ():
                raise NotSimple("OrderedDict called with arguments")
            return _OrderedDict()
        if func.name == _REBUILD:
            return self.tensor(*args) if len(args) == 6 else self.bad("rebuild arguments")
        raise NotSimple(f"global {func.name.replace(chr(10), '.')}")

    @staticmethod
    def bad(what: str):
        raise NotSimple(what)

    def tensor(self, storage, offset, size, stride, requires_grad, hooks) -> PtTensor:
        """``_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, backward_hooks)`` with no
        metadata argument (conj/neg bits would add one): a dense tensor whose elements lie in its storage."""
        ints = (type(offset) is int and type(size) is tuple and type(stride) is tuple and len(size) == len(stride)
                and all(type(x) is int for x in size + stride))
        if type(storage) is not PtStorage or not ints or requires_grad is not False:
            raise NotSimple("rebuild arguments of another kind")
        if type(hooks) is not _OrderedDict or hooks or hooks.__dict__:
            raise NotSimple("backward hooks")
        if offset < 0 or any(x < 0 for x in size + stride):
            raise NotSimple("negative geometry")
        if math.prod(size) > 0:
            last = offset + sum((n - 1) * s for n, s in zip(size, stride))
            if last >= storage.numel:
                raise NotSimple("a view outside its storage")
        elif offset > storage.numel:
            raise NotSimple("an offset outside its storage")
        return PtTensor(storage, offset, size, stride)

    def storage(self, pid: Any) -> PtStorage:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise NotSimple("a persistent id other than a storage")
        _, kind, key, location, numel = pid
        if type(kind) is not _Global or not kind.name.startswith("torch\n") or type(key) is not str \
                or type(location) is not str or type(numel) is not int or numel < 0:
            raise NotSimple("a storage id of another kind")
        dtype = STORAGE_DTYPES.get(kind.name[6:])
        if dtype is None:
            raise NotSimple(f"storage class {kind.name[6:]}")
        got = self.loaded.get(key)
        if got is not None:
            if got.dtype != dtype or got.numel != numel:
                raise NotSimple("a storage key reused with another type or size")
            return got
        rec = self.storages.get(key)
        if rec is None or rec[1] != numel * ITEMSIZE[dtype]:
            raise NotSimple(f"record data/{key} missing or of another size")
        st = self.loaded[key] = PtStorage(key, dtype, numel, rec[0], self.file)
        return st


#: the OrderedDict class (imported here under its own name so the checks above read as type tests)
from collections import OrderedDict as _OrderedDict  # noqa: E402
