"""The wire between kfuzz's process and a worker: one message is a JSON header and the raw
bytes of some tensors.

A tensor travels as its whole storage plus its geometry (dtype, shape, strides, storage
offset), so the receiver rebuilds the same layout, fillers and guard bytes included:
a worker's inputs are bit for bit the ones kfuzz materialized and judges. Outputs travel
dense. The header is JSON, not pickle: a kernel can reach its worker's pipe, so what a
worker sends must be data that kfuzz parses, never code that it would run; ``unpack``
refuses a malformed message with ValueError.
"""
from __future__ import annotations

import ctypes
import json
import struct
import threading
from multiprocessing.connection import Connection
from queue import Queue
from typing import Mapping

import torch

from kfuzz.dtypes import torch_dtype

# bytes that may wait unread in a pipe without blocking the sender (Linux buffers ~200 KiB);
# more goes through a sender thread
DIRECT_SEND = 64 << 10


def storage_buffer(t: torch.Tensor):
    """The bytes of ``t``'s whole storage, without a copy where they are large."""
    st = t.untyped_storage()
    st = st if st.device.type == "cpu" else st.cpu()
    n = st.nbytes()
    if n <= 1 << 20:                 # small: one C-level copy is cheaper than a tensor view
        return ctypes.string_at(st.data_ptr(), n) if n else b""
    return torch.empty(0, dtype=torch.uint8).set_(st).numpy().data


def pack(header: tuple, tensors: list[torch.Tensor]) -> bytes:
    """One message: ``header`` and each tensor's bytes (its whole storage for a view, so
    the receiver rebuilds the same layout, fillers and guard bytes included)."""
    raws = [storage_buffer(t) for t in tensors]
    head = json.dumps([header, [len(r) for r in raws]], separators=(",", ":")).encode()
    return b"".join([struct.pack("<I", len(head)), head, *raws])


def unpack(msg: bytes | bytearray) -> tuple[tuple, list[torch.Tensor]]:
    """The header (lists for tuples) and each tensor's storage (uint8, owning its memory) of a
    ``pack`` message; ValueError if the message is not one."""
    try:
        (n,) = struct.unpack_from("<I", msg)
        header, sizes = json.loads(bytes(memoryview(msg)[4:4 + n]))
        if sum(sizes) != len(msg) - 4 - n or any(not isinstance(k, int) or k < 0 for k in sizes):
            raise ValueError("the tensors' sizes do not add up to the message")
    except (struct.error, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a kfuzz worker message ({e})") from None
    buf, at, out = bytearray(msg) if isinstance(msg, bytes) else msg, 4 + n, []
    for size in sizes:
        out.append(torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=at) if size
                   else torch.empty(0, dtype=torch.uint8))
        at += size
    return header, out


def geometry(t: torch.Tensor) -> tuple:
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), t.storage_offset()


def rebuild(storage: torch.Tensor, geometry: tuple, device: str | torch.device = "cpu") -> torch.Tensor:
    dtype, shape, stride, offset = geometry
    flat = storage.view(torch_dtype(dtype)) if storage.numel() else torch.empty(0, dtype=torch_dtype(dtype))
    if str(device) != "cpu":
        flat = flat.to(device)
    return flat.as_strided(shape, stride, offset)


def dense_outputs(outputs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each output dense and alone in its storage (a view of a larger buffer is copied)."""
    out = []
    for t in outputs.values():
        t = t.detach().contiguous()
        out.append(t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone())
    return out


class Outbox:
    """Sends messages on ``conn``, in order, without ever blocking the sender on the receiver:
    directly while the pipe has room (``unread`` bytes may wait in it), else through a
    sender thread. A large message could fill the pipe while the receiver blocks on sending
    its own reply (a deadlock), or hangs (its sender could not act on a timeout)."""

    def __init__(self, conn: Connection, name: str = "kfuzz-sender"):
        self.conn, self.name = conn, name
        self.queue: Queue | None = None         # the sender thread's, once needed

    def post(self, msg: bytes, unread: int = 0) -> None:
        if unread + len(msg) <= DIRECT_SEND and (self.queue is None or self.queue.unfinished_tasks == 0):
            try:
                self.conn.send_bytes(msg)
            except OSError:   # the receiver died: its owner finds out from the connection
                pass
            return
        if self.queue is None:
            self.queue = Queue()
            threading.Thread(target=_sender, args=(self.conn, self.queue), daemon=True, name=self.name).start()
        self.queue.put(msg)

    def close(self) -> None:
        """End the sender thread, once it has sent or dropped what it holds."""
        if self.queue is not None:
            self.queue.put(None)


def _sender(conn: Connection, queue: Queue) -> None:
    """Send what ``queue`` holds, in order, until ``None``; a dead receiver's messages are dropped."""
    while True:
        msg = queue.get()
        try:
            if msg is None:
                return
            conn.send_bytes(msg)
        except (OSError, ValueError, TypeError):   # the receiver died or the connection was closed
            # under this thread (it then has no handle: TypeError); keep draining to None
            pass
        finally:
            queue.task_done()
