"""The violation channel: how a confined worker tells kfuzz of each escape it tried.

The worker's end is a write-only descriptor on which its audit hook sends (``tell``) each
attempt it names, one line of JSON, before the kernel can catch or undo anything. kfuzz's end
is ``Channel``, which reads those lines: kfuzz's verdict rests on this channel and the
worker's exit status, never on the worker's own record.

Refuses: a line that is not a report of a known kind, or a channel the worker closed or tore
while it still answers; each is a violation itself (``sandbox-channel``). ``tell`` never
blocks: a full or closed channel is kfuzz's to notice.
"""
from __future__ import annotations

import json
import os
import socket

from kfuzz.sandbox.policy import CHANNEL, VIOLATIONS


def tell(channel: int, found: tuple[str, str]) -> None:
    """Send one named attempt to kfuzz (a line of JSON); a full or closed channel is kfuzz's
    to notice. One a call, on a non-blocking descriptor: a kernel that repeats an attempt in a
    loop cannot fill the channel and hang on it."""
    try:
        os.write(channel, (json.dumps(list(found))[:2000] + "\n").encode())
    except OSError:
        pass


class Channel:
    """kfuzz's end of a worker's violation channel: a socket pair (a socket, unlike a pipe,
    cannot be reopened through /proc), the worker's end write-only. Each line is one attempt
    the worker's audit hook named; a line that is not one, or an end the worker closed while
    it still answers, is itself a violation (``sandbox-channel``)."""

    def __init__(self):
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ours.shutdown(socket.SHUT_WR)
        self.theirs.shutdown(socket.SHUT_RD)
        self.ours.setblocking(False)
        self.buffer, self.eof = b"", False
        self.found: list[tuple[str, str]] = []

    def handed_over(self) -> None:
        """The worker holds its end now: close kfuzz's copy, so that its closing shows."""
        self.theirs.close()

    def read(self) -> list[tuple[str, str]]:
        """Every attempt reported so far (in order), corrupt lines included as violations."""
        while not self.eof:
            try:
                data = self.ours.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                self.eof = True
                break
            self.buffer += data
            *lines, self.buffer = self.buffer.split(b"\n")
            for line in lines:
                try:
                    kind, detail = json.loads(line)
                    if kind not in VIOLATIONS or not isinstance(detail, str):
                        raise ValueError(kind)
                    self.found.append((kind, detail[:2000]))
                except (ValueError, TypeError):
                    self.found.append((CHANNEL, f"the violation channel carried a line that is not a report: "
                                                f"{line[:200]!r}"))
        return self.found

    def verdict(self, answered: bool) -> tuple[str, str] | None:
        """The first attempt reported; when the worker ``answered`` (so it should still hold
        its end), a closed channel or a torn line is a violation too."""
        found = self.read()
        if found:
            return found[0]
        if answered and (self.eof or self.buffer):
            return CHANNEL, "the kernel's process closed or tore its violation channel"
        return None

    def close(self) -> None:
        self.ours.close()
        if self.theirs.fileno() >= 0:
            self.theirs.close()
