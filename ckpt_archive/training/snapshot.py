"""A consistent copy of a live training state, taken into buffers that are reused from one save to the next.

:class:`Snapshotter` is what :class:`~ckpt_archive.training.checkpointer.Checkpointer` calls in the training
thread: the only part of a save that blocks training. It copies every tensor's *storage* once (tensors that
share a storage, tied weights and views, keep sharing it in the copy, so the archive is the one ``pack`` makes
of the live state), into a buffer kept from the previous save when the storage has the same size and kind:
no allocation and no page faults after the first save. Tensors on a GPU are copied device -> host into
*pinned* buffers (``non_blocking``, then one synchronisation per device before returning), so the copy runs
at the bus's speed and the live tensors may change as soon as :meth:`Snapshotter.take` returns. NumPy arrays
are copied too; plain values (ints, floats, strings, tuples, RNG states) are deep-copied; containers are
rebuilt (``copy.deepcopy`` with the tensor copies pre-seeded in its memo, so dict subclasses, OrderedDict
attributes such as a state_dict's ``_metadata`` and aliasing between containers come back as they were).

A tensor's copy keeps what the archive records of it: its dtype, shape, stride and storage offset, its lazy
conjugate / negative bits, its Python attributes, whether it is an ``nn.Parameter`` and ``requires_grad``
(sparse, quantized, nested and meta tensors are copied whole, as ``clone`` does), and its original device (attribute ``DEVICE_ATTR``, read
by :func:`ckpt_archive.format.state_tree.encode`), so the manifest says ``cuda:0`` for a tensor that lived
there, as ``pack`` of the live state would.

A DTensor (``torch.distributed.tensor``) is snapshotted as its local shard; the caller (the distributed
checkpointer) gets its layout through ``on_dtensor``. Whether a tensor is a DTensor is decided without
importing ``torch.distributed.tensor`` (whose import pulls in sympy and mpmath, seconds on a first save): a
DTensor can only exist once that module is loaded, so an unloaded module means there is none.

**Who may write the buffers.** The buffers are owned by at most one holder at a time (:meth:`Snapshotter.acquire`,
:meth:`Snapshotter.release`): the Checkpointer makes each save the holder from before its copy until its
background write has finished reading them (successfully or not), and :meth:`Snapshotter.take` refuses to
write buffers another holder owns. So a copy can never overwrite a snapshot that a write may still be
reading, whatever interrupted whom; :meth:`Snapshotter.holds` and :attr:`Snapshotter.writes` (a count of
every buffer write) let the write check, before its generation is marked usable, that it held the buffers
the whole time and that nothing wrote them after its copy.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
import threading
from typing import Any, Callable

#: Attribute set on a snapshot tensor copied from a non-CPU device: that device, as a string.
DEVICE_ATTR = "_ckpt_archive_device"


@dataclasses.dataclass
class SnapshotStats:
    """What one :meth:`Snapshotter.take` did.

    Attributes:
        tensor_bytes: bytes of tensor storages copied. device_bytes: of those, bytes copied from a GPU.
        allocated_bytes: bytes of new buffers allocated (0 when every buffer was reused).
        tensors: tensor leaves found. storages: distinct storages copied.
    """

    tensor_bytes: int = 0
    device_bytes: int = 0
    allocated_bytes: int = 0
    tensors: int = 0
    storages: int = 0


def loaded(name: str) -> Any:
    """Module ``name`` when it is imported and its import has finished, else None -- never importing it.

    A state can only hold a ``torch.Tensor`` or a ``numpy.ndarray`` once their module is imported, so a
    snapshot needs neither import otherwise (``import torch`` is ~2 s: a first save of a state of plain values
    paid it in the training thread). A module another thread is still importing counts as absent: its
    attributes may not exist yet, and running its operations then crashed the process (SIGSEGV in
    :func:`warm_up`, found by a break test); nothing can have been built from it yet either.
    """
    mod = sys.modules.get(name)
    if mod is None or getattr(getattr(mod, "__spec__", None), "_initializing", False):
        return None
    return mod


def _walk_tensors(obj: Any, out: list, seen: set, kinds: tuple) -> None:
    """Every object of ``kinds`` (tensors, NumPy arrays) reachable through dict/list/tuple/OrderedDict
    attributes, in order."""
    if not kinds:
        return
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, kinds):
            if id(node) not in seen:
                seen.add(id(node))
                out.append(node)
            continue
        if isinstance(node, dict):
            if id(node) in seen:
                continue
            seen.add(id(node))
            extra = list(vars(node).values()) if hasattr(node, "__dict__") else []
            stack.extend(reversed(extra))
            for k, v in reversed(list(node.items())):
                stack.append(v)
                stack.append(k)
        elif isinstance(node, (list, tuple)):
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.extend(reversed(node))


class Snapshotter:
    """Copies nested states into buffers reused across calls (one instance per checkpointer).

    Args:
        pin_memory: pin host buffers for GPU tensors (default True; pinned memory is what lets the
            device -> host copy run asynchronously and at full bus speed).
        on_dtensor: called ``(snapshot_local_tensor, dtensor)`` for every DTensor found (its local shard
            is what the snapshot holds); None: DTensors are refused with a message naming the distributed
            checkpointer.

    The buffers of the previous :meth:`take` are overwritten by the next one. A caller that keeps a
    snapshot while it is read elsewhere (the Checkpointer: until its background write finished) makes
    itself the buffers' holder first (:meth:`acquire`) and passes itself as ``owner`` to :meth:`take`; while
    one holder owns them, every other :meth:`take` and :meth:`acquire` raises :class:`BuffersBusy` instead
    of writing.
    """

    def __init__(self, *, pin_memory: bool = True, on_dtensor: Callable[[Any, Any], None] | None = None):
        self.pin_memory = pin_memory
        self.on_dtensor = on_dtensor
        self._buffers: dict[tuple, Any] = {}  # (slot, kind, nbytes) -> uint8 tensor / ndarray
        self._slot_key: dict[int, tuple] = {}  # slot -> its key in _buffers (one buffer per slot)
        self.last = SnapshotStats()
        self._holder: Any = None
        self._holder_lock = threading.Lock()
        #: buffer writes so far (one per storage or array copied, counted before it is written): a holder
        #: that notes it after its copy knows, by comparing later, whether anything wrote the buffers since
        self.writes = 0

    # -- ownership ---------------------------------------------------------------------------------------------
    def acquire(self, owner: Any) -> None:
        """Make ``owner`` the buffers' only holder (until :meth:`release` by the same owner).

        Raises:
            BuffersBusy: another holder owns the buffers (its snapshot may still be read).
        """
        with self._holder_lock:
            if self._holder is not None and self._holder is not owner:
                raise BuffersBusy(f"the snapshot buffers are held by {self._holder!r}: its snapshot may still be "
                                  f"read, so they are not overwritten")
            self._holder = owner

    def release(self, owner: Any) -> bool:
        """Give the buffers up, if ``owner`` holds them (a no-op otherwise, so a late release is harmless).

        Returns:
            True when ``owner`` held them.
        """
        with self._holder_lock:
            if self._holder is owner and owner is not None:
                self._holder = None
                return True
            return False

    def holds(self, owner: Any) -> bool:
        """Whether ``owner`` holds the buffers now."""
        return owner is not None and self._holder is owner

    def _buffer(self, slot: int, kind: str, nbytes: int, stats: SnapshotStats):
        key = (slot, kind, nbytes)
        buf = self._buffers.get(key)
        if buf is None:
            import numpy as np
            import torch

            if kind == "numpy":
                buf = np.empty(nbytes, dtype=np.uint8)
            else:
                pin = kind == "pinned"
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin, device="cpu")
            # drop any buffer this slot held at another size/kind (the state changed shape)
            old = self._slot_key.get(slot)  # (a lookup, not a scan of every slot: O(tensors^2) per save)
            if old is not None:
                del self._buffers[old]
            self._buffers[key] = buf
            self._slot_key[slot] = key
            stats.allocated_bytes += nbytes
        return buf

    def take(self, state: Any, *, owner: Any = None, on_dtensor: Callable[[Any, Any], None] | None = None) -> Any:
        """Return a copy of ``state`` that no later change of the live tensors can alter.

        Args:
            state: nested dict/list/tuple of tensors (any device), NumPy arrays and plain values.
            owner: the holder the buffers were acquired for (:meth:`acquire`); None: nobody may hold them.
            on_dtensor: as the constructor's, for this copy only (None: the constructor's).

        Returns:
            the copy, same structure and types; tensors are CPU tensors over this snapshotter's buffers
            (valid until the next :meth:`take`), with Parameter-ness, ``requires_grad``, dtype, shape,
            stride, storage offset and storage sharing kept.

        Raises:
            BuffersBusy: the buffers are held by another owner (checked before any byte is written).
            TypeError: a DTensor without ``on_dtensor`` (use the distributed checkpointer).
        """
        if self._holder is not owner:
            raise BuffersBusy(f"the snapshot buffers are held by {self._holder!r}, not by {owner!r}: its snapshot "
                              f"may still be read, so they are not overwritten")
        on_dtensor = on_dtensor or self.on_dtensor
        torch, np = loaded("torch"), loaded("numpy")  # neither imported here (see loaded)
        found: list = []
        _walk_tensors(state, found, set(), tuple(k for k in (torch and torch.Tensor, np and np.ndarray) if k))
        memo: dict[int, Any] = {}
        run = _Take()
        stats = run.stats
        for obj in found:
            if np is not None and isinstance(obj, np.ndarray):
                memo[id(obj)] = self._copy_ndarray(obj, run)
                continue
            stats.tensors += 1
            t = obj
            src = t
            is_dtensor = is_dtensor_instance(t)
            if is_dtensor:
                if on_dtensor is None:
                    raise TypeError("a DTensor is in the state: save it with the Checkpointer under an initialised "
                                    "torch.distributed process group (it writes each rank's shards)")
                src = t.to_local()
            if src.layout != torch.strided or src.is_quantized or src.is_meta or src.is_nested:
                # sparse, quantized, meta, nested: a plain copy (pack encodes them through torch's rebuild)
                memo[id(t)] = _with_attrs(_copy_whole(src, torch), t, memo)
                continue
            copy_t = _like_source(self._copy_storage(src, run), src, t, torch)
            if is_dtensor:
                on_dtensor(copy_t, t)
            memo[id(t)] = _with_attrs(copy_t, t, memo)
        for dev in run.devices:  # the copies were queued on each device's current stream: wait for them
            torch.cuda.current_stream(dev).synchronize()
        out = copy.deepcopy(state, memo)
        if self._holder is not owner:  # another copy took the buffers while this one wrote them
            raise BuffersBusy(f"the snapshot buffers passed from {owner!r} to {self._holder!r} during its copy: "
                              f"this copy is not used")
        self.last = stats
        return out

    def _copy_ndarray(self, obj, run: "_Take"):
        """A NumPy array's copy into the next buffer (an object array: a deep copy, refused later by the
        encoder with its path)."""
        import numpy as np

        if obj.dtype.hasobject:
            return copy.deepcopy(obj)
        buf = self._buffer(run.next_slot(), "numpy", obj.nbytes, run.stats)
        view = buf.view(obj.dtype).reshape(obj.shape) if obj.nbytes else np.empty(obj.shape, obj.dtype)
        self.writes += 1
        np.copyto(view, obj)
        run.stats.tensor_bytes += obj.nbytes
        return view

    def _copy_storage(self, src, run: "_Take"):
        """A CPU tensor over the copy of ``src``'s storage (copied once per storage: views keep sharing it),
        with ``src``'s dtype, shape, strides and offset; a device's copy is queued on its current stream."""
        import torch

        from ckpt_archive.format.tensor_bytes import empty_tensor

        st = src.untyped_storage()
        nbytes = st.nbytes()
        if nbytes == 0:
            return torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="cpu")
        sid = (str(src.device), st.data_ptr(), nbytes)
        base = run.storages.get(sid)
        if base is None:
            on_gpu = src.device.type != "cpu"
            kind = "pinned" if (on_gpu and self.pin_memory and torch.cuda.is_available()) else "host"
            base = self._buffer(run.next_slot(), kind, nbytes, run.stats)
            whole = torch.empty(0, dtype=torch.uint8, device=src.device).set_(st)
            self.writes += 1
            base.copy_(whole, non_blocking=on_gpu and kind == "pinned")
            run.storages[sid] = base
            run.stats.storages += 1
            run.stats.tensor_bytes += nbytes
            if on_gpu:
                run.stats.device_bytes += nbytes
                run.devices.add(src.device)
        return empty_tensor(src.dtype).set_(base.untyped_storage(), src.storage_offset(), src.shape, src.stride())


def warm_up() -> None:
    """Run the torch operations a :meth:`Snapshotter.take` of a CPU tensor uses once, on a one-element tensor,
    through a throwaway snapshotter (the caller's buffers and counters stay untouched).

    Why: the first call of each operation in a process costs ~10-130 us more than later ones (torch's
    argument parser and dispatcher set up per operation), ~0.5-0.7 ms over the seven operations: for a small
    state, several times a ``clone()``. The Checkpointer calls this at construction, so its first ``save``
    costs what later saves cost (issue 29: a first save <= 2x a ``clone()`` of the state). A no-op when torch
    is not imported, or not yet completely (:func:`loaded`): a state without tensors needs none of it, and
    importing torch here would cost seconds.
    """
    torch = loaded("torch")
    if torch is None:  # not imported, or another thread is still importing it: nothing to warm up
        return
    probe = torch.zeros(2, device="cpu")
    Snapshotter(pin_memory=False).take({"w": probe, "view": probe[1:], "param": torch.nn.Parameter(torch.zeros(1, device="cpu"))})


class _Take:
    """One :meth:`Snapshotter.take`: its stats, the next buffer slot, storages copied, devices to wait for."""

    def __init__(self):
        self.stats = SnapshotStats()
        self.slot = 0
        self.storages: dict[tuple, Any] = {}   # storage id -> (uint8 buffer tensor)
        self.devices: set = set()

    def next_slot(self) -> int:
        self.slot += 1
        return self.slot - 1


def _like_source(copy_t, src, t, torch):
    """The copy with what is not in the storage's bytes set as on the source: the lazy conjugate / negative
    bits (a conj view over the same bytes reads as the source reads), Parameter-ness, ``requires_grad``,
    the source's device (as an attribute)."""
    if src.is_neg():
        copy_t = torch._neg_view(copy_t)
    if src.is_conj():
        copy_t = copy_t.conj()
    if isinstance(src, torch.nn.Parameter) or isinstance(t, torch.nn.Parameter):
        copy_t = torch.nn.Parameter(copy_t, requires_grad=src.requires_grad)
    elif src.requires_grad:
        copy_t.requires_grad_(True)
    if src.device.type != "cpu":
        setattr(copy_t, DEVICE_ATTR, str(src.device))
    return copy_t


def _copy_whole(src: Any, torch: Any) -> Any:
    """A detached copy of a tensor that has no plain strided storage (sparse, quantized, meta, nested),
    keeping Parameter-ness and ``requires_grad``; CPU tensors stay on the CPU, others are copied there."""
    copy_t = src.detach().clone()
    if isinstance(src, torch.nn.Parameter):
        copy_t = torch.nn.Parameter(copy_t, requires_grad=src.requires_grad)
    elif src.requires_grad:
        copy_t.requires_grad_(True)
    return copy_t


def _with_attrs(copy_t: Any, t: Any, memo: dict) -> Any:
    """``copy_t`` with the Python attributes of ``t`` (``vars``) copied onto it, deep-copied through the
    snapshot's memo (so a tensor held in an attribute is the snapshot's copy too). ``pack`` stores them."""
    attrs = getattr(t, "__dict__", None)
    for name, value in (attrs or {}).items():
        if name != DEVICE_ATTR:
            setattr(copy_t, name, copy.deepcopy(value, memo))
    return copy_t


class BuffersBusy(RuntimeError):
    """The snapshot buffers are held by another save, whose snapshot may still be read: nothing was written."""


def is_dtensor_instance(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing ``torch.distributed.tensor`` (seconds: sympy, mpmath).

    A DTensor's class lives in that package, so no DTensor exists while the package is not loaded; when it is,
    the check is an ordinary ``isinstance``.
    """
    mod = loaded("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


__all__ = ["Snapshotter", "SnapshotStats", "BuffersBusy", "DEVICE_ATTR", "is_dtensor_instance", "warm_up", "loaded"]
