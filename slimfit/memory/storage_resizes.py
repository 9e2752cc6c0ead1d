"""Storages resized in place, told to the CPU tracker: calls that reach no dispatcher.

FSDP2 frees a layer's gathered parameters after its forward by resizing their storage to 0 bytes
(``UntypedStorage.resize_(0)``) and allocates it again before the layer's backward (``resize_(size)``),
while autograd still holds the tensor it saved. Neither call is an op a dispatch mode sees, so without this
the tracker would count those bytes as saved from the forward to the end of backward (333 MiB on every rank
for BERT-base: each layer's gathered weights). Inside ``watch(callback)`` every ``UntypedStorage.resize_`` is
followed by ``callback(storage)``.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["watch"]


@contextlib.contextmanager
def watch(callback):
    """``callback(storage)`` after every ``torch.UntypedStorage.resize_`` inside the block (restored after)."""
    cls = torch.UntypedStorage
    original = cls.__dict__.get("resize_")
    inherited = cls.resize_

    def resize_(self, size):
        out = inherited(self, size)
        callback(self)
        return out

    cls.resize_ = resize_
    try:
        yield
    finally:
        if original is None:
            del cls.resize_
        else:
            cls.resize_ = original
