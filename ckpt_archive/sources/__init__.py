"""Readers of input formats: turn what a trainer wrote into a :class:`SourceCheckpoint`.

A source is either one file (a ``torch.save`` file, a ``.safetensors`` file) or a folder (a Hugging
Face Trainer ``checkpoint-N/``, an Accelerate ``save_state`` folder, per-rank files, a
torch.distributed.checkpoint folder). The shared types, the registry and :func:`read_source` live in
:mod:`ckpt_archive.sources.base`; one module per format registers its reader:

* :mod:`~ckpt_archive.sources.torchfile`: one ``torch.save`` file (``weights_only`` loads only);
* :mod:`~ckpt_archive.sources.folders`: a ``.safetensors`` file, per-rank files, any other folder;
* :mod:`~ckpt_archive.sources.hf`: Hugging Face Trainer and Accelerate folders;
* :mod:`~ckpt_archive.sources.lightning`: Lightning ``.ckpt`` files;
* :mod:`~ckpt_archive.sources.dcp`: torch.distributed.checkpoint folders.

:mod:`~ckpt_archive.sources.files` walks a folder and gives every file a kind (the machinery the
folder readers share). The built-in readers are imported here explicitly: a reader that fails to
import is a packaging error and fails loudly, never a silently missing format.
"""
from __future__ import annotations

from ckpt_archive.sources.base import (FILE_KINDS, READERS, SourceCheckpoint, SourceFile, from_object, read_source,
                                       register)

# Each built-in reader registers itself on import. Plain imports, so a missing module fails here, by name.
import ckpt_archive.sources.torchfile  # noqa: E402,F401
import ckpt_archive.sources.folders  # noqa: E402,F401
import ckpt_archive.sources.hf  # noqa: E402,F401
import ckpt_archive.sources.lightning  # noqa: E402,F401
import ckpt_archive.sources.dcp  # noqa: E402,F401

__all__ = ["FILE_KINDS", "READERS", "SourceCheckpoint", "SourceFile", "from_object", "read_source", "register"]
