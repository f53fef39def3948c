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
import os
import struct
import sys
import zipfile
from collections import OrderedDict as _OrderedDict  # its own name: the checks read as type tests
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
    """The source file, mapped read-only once (tensor bytes are read from the map, never copied whole).

    [break] Mapped only under a read lease (:class:`~ckpt_archive.format.read_lease.ReadLease`): a file
    truncated by another process while mapped would end this process with SIGBUS. Without a lease the
    bytes are read with ``pread`` instead (:attr:`map` is None); either way a file cut short or opened for
    writing under the read raises :class:`~ckpt_archive.errors.SourceChanged` naming it (exit 2).

    When pack gives its leases back (:meth:`~ckpt_archive.format.read_lease.LeaseScope.give_back`, once it has
    read the source) the map is dropped with the lease, and reading is refused until the scope takes the file
    again (:meth:`~ckpt_archive.format.read_lease.LeaseScope.take_again`: the same file, proven by ``fstat``),
    which maps it anew, or reads it with ``pread`` where no lease is granted now.
    """

    def __init__(self, path: Path):
        from ckpt_archive.format.exact_bytes import file_identity
        from ckpt_archive.format.read_lease import ReadLease

        self.path = Path(path)
        #: the file as it was when mapped (:func:`~ckpt_archive.format.exact_bytes.file_identity`): the one a
        #: scan of the same identity read, whose range fingerprints are then the entries' (repo/writer.py)
        self.identity = file_identity(self.path)
        #: held for as long as this object (and, past it, as long as the map made from its descriptor)
        self.lease = ReadLease(self.path)
        #: the file's size when opened (bytes)
        self.size = os.fstat(self.lease.fd).st_size
        self.map = None
        self._map_through(self.lease)

    def _map_through(self, lease) -> None:
        """Read through ``lease``: map the file where it is held, else (:attr:`map` None) ``pread`` its fd."""
        self.lease = lease
        lease.hold_for(self)
        self.map = None
        if not self.size:
            self.map = b""
        elif lease.held:
            self.map = mmap.mmap(lease.fd, self.size, access=mmap.ACCESS_READ)

    def _lease_given_back(self) -> None:
        """The scope gives the lease back: drop the map first (views still made from it are never read again;
        closing it then waits for them to go)."""
        old, self.map = self.map, None
        if isinstance(old, mmap.mmap):
            try:
                old.close()
            except BufferError:  # a view of it is still referenced somewhere: it goes with the last one
                pass

    def _lease_taken_again(self, lease) -> None:
        """The scope took the file again (proven the same by ``fstat``): read through the new lease."""
        self._map_through(lease)

    def _check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"{nbytes} bytes at {offset} lie outside the file's {self.size}")
        if self.lease.fd < 0:  # given back: nothing may read the file until it is taken again (and proven)
            raise RuntimeError(f"{self.path}: read after its read lease was given back")
        self.lease.check()

    def read(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` at ``offset``, copied (a scalar's few bytes).

        Raises:
            ValueError: the range lies outside the file as opened. SourceChanged: the file changed.
        """
        self._check(offset, nbytes)
        if self.map is not None:
            return bytes(self.map[offset:offset + nbytes])
        from ckpt_archive.format.read_lease import pread_exact

        buf = bytearray(nbytes)
        pread_exact(self.lease.fd, buf, offset, self.path)
        return bytes(buf)

    def array(self, offset: int, nbytes: int):
        """A read-only 1-D uint8 NumPy array of ``nbytes`` at ``offset``: a view of the map, or (no lease)
        the bytes read into fresh memory.

        Raises:
            ValueError: the range lies outside the file as opened. SourceChanged: the file changed.
        """
        import numpy as np

        self._check(offset, nbytes)
        if nbytes == 0:
            return np.zeros(0, dtype=np.uint8)
        if self.map is not None:
            return np.frombuffer(self.map, dtype=np.uint8, count=nbytes, offset=offset)
        from ckpt_archive.format.read_lease import pread_exact

        out = np.empty(nbytes, dtype=np.uint8)
        pread_exact(self.lease.fd, out, offset, self.path)
        out.flags.writeable = False
        return out

    def view(self, offset: int, nbytes: int):
        """A read-only uint8 NumPy view of ``nbytes`` at ``offset`` (file pages, not anonymous memory); up to
        ``planes.SMALL_PLANES_BYTES`` a read-only 1-D ``memoryview`` (format ``B``) instead, so a pack of a
        small state does not import NumPy (~0.1 s) to read it (the codec encodes such chunks without it).

        Raises:
            ValueError: the range lies outside the file as opened. SourceChanged: the file changed.
        """
        from ckpt_archive.format.planes import SMALL_PLANES_BYTES

        if nbytes <= SMALL_PLANES_BYTES:
            if self.map is None:
                return memoryview(self.read(offset, nbytes))
            self._check(offset, nbytes)
            return memoryview(self.map)[offset:offset + nbytes].toreadonly() if nbytes else memoryview(b"")
        return self.array(offset, nbytes)


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
        raw = self.storage.file.read(at, size)
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
        elems = st.file.array(st.offset, st.numel * size).view(np.dtype((np.void, size)))
        view = np.lib.stride_tricks.as_strided(elems[self.offset:], shape=self.shape,
                                               strides=[s * size for s in self.stride], writeable=False)
        return np.ascontiguousarray(view).reshape(-1).view(np.uint8)

    def contiguous_pieces(self):
        """:meth:`contiguous_bytes` as pieces of at most ``fingerprint.VIEW_PIECE_BYTES`` (a view of a stride of
        0 is never gathered whole)."""
        import numpy as np

        from ckpt_archive.format.fingerprint import view_pieces

        st, size = self.storage, ITEMSIZE[self.storage.dtype]
        if self.numel() == 0 or self.is_contiguous():
            return iter((self.contiguous_bytes(),))
        elems = st.file.array(st.offset, st.numel * size).view(np.dtype((np.void, size)))
        view = np.lib.stride_tricks.as_strided(elems[self.offset:], shape=self.shape,
                                               strides=[s * size for s in self.stride], writeable=False)
        return view_pieces(view, size, lambda a: np.ascontiguousarray(a).reshape(-1).view(np.uint8))

    def __repr__(self) -> str:
        return f"PtTensor(dtype={self.dtype}, shape={list(self.shape)}, storage={self.storage.key})"


class _Global:
    """A ``GLOBAL`` opcode's name: a token, never resolved to an object."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


#: the immutable constants' opcodes: EMPTY_TUPLE, NONE, NEWTRUE, NEWFALSE
_CONSTANTS = {0x29: (), 0x4E: None, 0x88: True, 0x89: False}
_ODICT = "collections\nOrderedDict"
_REBUILD = "torch._utils\n_rebuild_tensor_v2"
_MAX_VERSION = 3
_INT64 = 1 << 63  # torch keeps sizes, strides and offsets as int64 (and byte counts of them)


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
            if rec[1] > 1 << 16 or not rec[4]:
                raise NotSimple(f"record {name} is unexpectedly large or compressed")
            return zf.read(f"{prefix}/{name}")

        if f"{prefix}/constants.pkl" in by_name:
            raise NotSimple("a TorchScript archive")
        # the records torch.load reads besides the pickle, read as it reads them (torch/serialization.py _load,
        # caffe2/serialize/inline_container.cc): one it would refuse makes the file NotSimple, so torch decides
        version = small(".data/version") if f"{prefix}/.data/version" in by_name else small("version")
        if version is None or version.strip() not in {str(v).encode() for v in range(1, _MAX_VERSION + 1)}:
            raise NotSimple(f"file format version {version!r}")
        order = small("byteorder")
        if order not in (None, b"little"):
            raise NotSimple(f"byte order {order!r}")
        alignment = small(".storage_alignment")
        if alignment is not None:
            int(alignment)  # torch: int(...) of it, a ValueError for anything else
        serialization_id = small(".data/serialization_id")
        if serialization_id is not None:
            serialization_id.decode("utf-8")  # torch hands it to Python as str
        pkl = by_name.get(f"{prefix}/data.pkl")
        if pkl is None or not pkl[4]:
            raise NotSimple("no data.pkl, or a compressed one (torch.save never compresses)")
        data = zf.read(pkl[3])
    storages = {name[len(prefix) + 6:]: (start, length) for start, length, _, name, stored in records
                if stored and name.startswith(f"{prefix}/data/")}
    file = PtFile(path)
    return _Machine(data, storages, file).run(), file


def _check_geometry(storage: "PtStorage", offset: int, size: tuple, stride: tuple) -> None:
    """A dense tensor's geometry (elements) lies in its storage and within int64, as torch requires.

    Raises:
        NotSimple: negative, beyond int64 (torch refuses it: "Overflow when unpacking long"), or outside the
            storage.
    """
    if offset < 0 or any(x < 0 for x in size + stride):
        raise NotSimple("negative geometry")
    if max((offset, *size, *stride)) >= _INT64 or math.prod(size) * ITEMSIZE[storage.dtype] >= _INT64:
        raise NotSimple("geometry beyond int64")
    if math.prod(size) > 0:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= storage.numel:
            raise NotSimple("a view outside its storage")
    elif offset > storage.numel:
        raise NotSimple("an offset outside its storage")


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
        """Interpret the pickle to its ``STOP``: each opcode goes to its handler in :attr:`_HANDLERS` (one
        per opcode admitted; any other opcode is refused)."""
        self.stack: list = []
        self.meta: list = []       # the stacks MARK set aside
        self.memo: dict[int, Any] = {}
        handlers = self._HANDLERS
        while True:
            op = self.take(1)[0]
            handler = handlers.get(op)
            if handler is None:
                raise NotSimple(f"opcode {op:#04x}")
            if handler(self, op):
                return self.clean(self.stack.pop())

    # Opcode handlers: ``handler(self, op)``; only STOP returns True.

    def _proto(self, op: int) -> None:  # PROTO
        self.take(1)

    def _constant(self, op: int) -> None:  # EMPTY_TUPLE, NONE, NEWTRUE, NEWFALSE
        self.stack.append(_CONSTANTS[op])

    def _empty_dict(self, op: int) -> None:  # EMPTY_DICT
        self.stack.append({})

    def _empty_list(self, op: int) -> None:  # EMPTY_LIST
        self.stack.append([])

    def _mark(self, op: int) -> None:  # MARK
        self.meta.append(self.stack)
        self.stack = []

    def _pop_mark(self) -> list:
        """The items pushed since the last MARK; the stack before it becomes the stack again."""
        items = self.stack
        self.stack = self.meta.pop()
        return items

    def _tuple_mark(self, op: int) -> None:  # TUPLE
        items = self._pop_mark()
        self.stack.append(self.tuple(items))

    def _tuple_n(self, op: int) -> None:  # TUPLE1..3
        n = op - 0x84
        if len(self.stack) < n:
            raise NotSimple("stack underflow")
        items = self.stack[-n:]
        del self.stack[-n:]
        self.stack.append(self.tuple(items))

    def _binint(self, op: int) -> None:  # BININT
        self.stack.append(struct.unpack("<i", self.take(4))[0])

    def _binint1(self, op: int) -> None:  # BININT1
        self.stack.append(self.take(1)[0])

    def _binint2(self, op: int) -> None:  # BININT2
        self.stack.append(struct.unpack("<H", self.take(2))[0])

    def _long1(self, op: int) -> None:  # LONG1
        n = self.take(1)[0]
        self.stack.append(int.from_bytes(self.take(n), "little", signed=True))

    def _binfloat(self, op: int) -> None:  # BINFLOAT
        self.stack.append(struct.unpack(">d", self.take(8))[0])

    def _binunicode(self, op: int) -> None:  # BINUNICODE (torch decodes with surrogatepass)
        n = struct.unpack("<I", self.take(4))[0]
        self.stack.append(str(self.take(n), "utf-8", "surrogatepass"))

    def _put(self, op: int) -> None:  # BINPUT, LONG_BINPUT
        i = self.take(1)[0] if op == 0x71 else struct.unpack("<I", self.take(4))[0]
        self.memo[i] = self.stack[-1]

    def _get(self, op: int) -> None:  # BINGET, LONG_BINGET
        i = self.take(1)[0] if op == 0x68 else struct.unpack("<I", self.take(4))[0]
        if i not in self.memo:
            raise NotSimple("memo key missing")
        self.stack.append(self.memo[i])

    def _append(self, op: int) -> None:  # APPEND
        item = self.clean(self.stack.pop())
        if type(self.stack[-1]) is not list:
            raise NotSimple("APPEND to a non-list")
        self.stack[-1].append(item)

    def _appends(self, op: int) -> None:  # APPENDS
        items = [self.clean(x) for x in self._pop_mark()]
        if type(self.stack[-1]) is not list:
            raise NotSimple("APPENDS to a non-list")
        self.stack[-1].extend(items)

    def _setitem(self, op: int) -> None:  # SETITEM
        v, k = self.clean(self.stack.pop()), self.clean(self.stack.pop())
        self.setitems(self.stack[-1], [k, v])

    def _setitems_mark(self, op: int) -> None:  # SETITEMS
        items = [self.clean(x) for x in self._pop_mark()]
        self.setitems(self.stack[-1], items)

    def _global(self, op: int) -> None:  # GLOBAL
        module, name = self.line(), self.line()
        self.stack.append(_Global(f"{module}\n{name}"))

    def _reduce(self, op: int) -> None:  # REDUCE
        args = self.stack.pop()
        self.stack[-1] = self.reduce(self.stack[-1], args)

    def _build(self, op: int) -> None:  # BUILD
        state = self.clean(self.stack.pop())
        inst = self.stack[-1]
        if type(inst) is not _OrderedDict or type(state) is not dict:
            raise NotSimple("BUILD of something other than an OrderedDict's attributes")
        inst.__dict__.update(state)

    def _binpersid(self, op: int) -> None:  # BINPERSID
        self.stack.append(self.storage(self.stack.pop()))

    def _stop(self, op: int) -> bool:  # STOP
        return True

    #: opcode -> handler: the protocol-2 subset admitted (see the module docstring)
    _HANDLERS = {
        0x80: _proto, 0x29: _constant, 0x4E: _constant, 0x88: _constant, 0x89: _constant,
        0x7D: _empty_dict, 0x5D: _empty_list, 0x28: _mark, 0x74: _tuple_mark,
        0x85: _tuple_n, 0x86: _tuple_n, 0x87: _tuple_n,
        0x4A: _binint, 0x4B: _binint1, 0x4D: _binint2, 0x8A: _long1, 0x47: _binfloat, 0x58: _binunicode,
        0x71: _put, 0x72: _put, 0x68: _get, 0x6A: _get,
        0x61: _append, 0x65: _appends, 0x73: _setitem, 0x75: _setitems_mark,
        0x63: _global, 0x52: _reduce, 0x62: _build, 0x51: _binpersid, 0x2E: _stop,
    }

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
        _check_geometry(storage, offset, size, stride)
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



__all__ = ["STORAGE_DTYPES", "ITEMSIZE", "NotSimple", "PtFile", "PtStorage", "PtTensor", "read"]
