"""Errors of a certify run that end it: not verdicts, but reasons it cannot go on."""

from __future__ import annotations

from pagedkv.errors import PagedKVError


class ServerUnreachable(PagedKVError):
    """The server did not answer (connection refused, timeout) or answered what is not the
    OpenAI API (CRT-003)."""
