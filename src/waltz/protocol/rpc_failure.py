"""A failure on the wire (Java's StorageRpcException), as the storage and the storage admin protocols carry it
in their failure responses, sans-I/O (primitives as in :mod:`waltz.protocol.wire`)::

    string message · i32 n · n x (string class · string method · string file · i32 line)

Stack frames are innermost first, as Java prints them. The first frame's ``class`` is the Waltz error class
name (:func:`waltz.errors.wire_name`), so :func:`waltz.protocol.storage.failure_to_error` rebuilds an error
of the same meaning; null strings from a Java peer decode as "". A reader raises
:class:`~waltz.errors.RemoteProtocolError` for a frame count the payload cannot hold.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Final, NamedTuple

from waltz.errors import wire_name
from waltz.protocol.wire import Reader, Writer

__all__ = [
    "MAX_FAILURE_FRAMES",
    "StackFrame",
    "StorageRpcFailure",
    "read_failure",
    "rpc_failure_of",
    "write_failure",
]

MAX_FAILURE_FRAMES: Final = 32
"""At most this many stack frames are sent in a failure (the receiver accepts any number that fits)."""

# Smallest encodings, used to bound counts before anything is allocated for them.
_MIN_STACK_FRAME_BYTES: Final = 4 + 4 + 4 + 4


class StackFrame(NamedTuple):
    """One frame of a StorageRpcException (innermost first)."""

    class_name: str
    method: str
    file: str
    line: int


@dataclass(frozen=True, slots=True)
class StorageRpcFailure:
    """The wire form of a failure (Java's StorageRpcException): a message and stack frames."""

    message: str
    frames: tuple[StackFrame, ...] = ()

    @property
    def class_name(self) -> str:
        """The error class name the sender put in the first frame ("" if there is none)."""
        return self.frames[0].class_name if self.frames else ""


def write_failure(w: Writer, failure: StorageRpcFailure) -> None:
    """Append a StorageRpcException."""
    w.string(failure.message)
    w.i32(len(failure.frames))
    for frame in failure.frames:
        w.string(frame.class_name).string(frame.method).string(frame.file).i32(frame.line)


def read_failure(r: Reader) -> StorageRpcFailure:
    """Read a StorageRpcException; null strings become ""."""
    message = r.string() or ""
    n = r.count(_MIN_STACK_FRAME_BYTES)
    frames = tuple(
        StackFrame(r.string() or "", r.string() or "", r.string() or "", r.i32()) for _ in range(n)
    )
    return StorageRpcFailure(message, frames)


def rpc_failure_of(exc: BaseException) -> StorageRpcFailure:
    """The wire form of ``exc``: its message and up to MAX_FAILURE_FRAMES frames of its traceback.

    The first frame always exists and names :func:`~waltz.errors.wire_name` of ``exc`` as its class, even
    for an exception that was never raised (no traceback), so the peer can rebuild the error's meaning.
    """
    summary = traceback.extract_tb(exc.__traceback__)
    innermost_first = list(reversed(summary))[:MAX_FAILURE_FRAMES]
    frames: list[StackFrame] = []
    for i, fs in enumerate(innermost_first):
        frames.append(
            StackFrame(
                wire_name(exc) if i == 0 else "", fs.name, os.path.basename(fs.filename), fs.lineno or 0
            )
        )
    if not frames:
        frames.append(StackFrame(wire_name(exc), "", "", 0))
    return StorageRpcFailure(str(exc) or type(exc).__name__, tuple(frames))
