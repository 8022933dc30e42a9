"""Masking secret values in captured output, the way CI systems mask them. Pure (no I/O but the pump's file
objects): imported by the control plane (registry/secrets.py: its log records and artifacts) and by the worker
(trainer/output_mask.py: a rank's own stdout/stderr, before torchrun or anyone else writes it down).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MIN_SECRET_LEN = 4
"""Shorter values are not masked (they would mangle ordinary text); the secret store refuses them instead."""


def secret_forms(value: str) -> list[str]:
    """The spellings of a secret that leak as often as the value itself, the way CI systems mask them: the value,
    its base64 (standard and URL-safe alphabets, with and without padding: an `Authorization: Basic` header, a
    Kubernetes Secret) and its URL encoding (`quote`, `quote_plus`: a token in a query string). Longest first;
    forms shorter than MIN_SECRET_LEN are left out. Not covered: the value inside a longer encoded string
    (`base64("user:" + value)` shares no characters with `base64(value)` beyond the first block)."""
    import base64
    from urllib.parse import quote, quote_plus

    if len(value) < MIN_SECRET_LEN:
        return []
    raw = value.encode()
    forms = {value, quote(value, safe=""), quote_plus(value)}
    for enc in (base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()):
        forms |= {enc, enc.rstrip("=")}
    return sorted((f for f in forms if len(f) >= MIN_SECRET_LEN), key=lambda f: (-len(f), f))


def spellings(values: Mapping[str, str]) -> dict[str, str]:
    """{value: name} -> {every spelling of every value (secret_forms): name}."""
    out: dict[str, str] = {}
    for value, name in values.items():
        for form in secret_forms(value):
            out.setdefault(form, name)
    return out


class StreamMasker:
    """Masks a byte stream chunk by chunk (a captured stdout/stderr pumped to a file). A secret split across two
    chunks is still masked: a match may only start in the part of the buffer from which the longest spelling
    fits, the rest (at most `longest - 1` bytes, and only from where a spelling could begin) is held, unmasked,
    until the next chunk or `flush`. The result is the same however the stream is cut. `values`: spelling -> name (`spellings` makes them from values)."""

    def __init__(self, values: Mapping[str, str]):
        source = dict(values)
        spellings = sorted((v.encode() for v in source), key=lambda v: (-len(v), v))
        self._labels = {v.encode(): f"***{n}***".encode() for v, n in source.items()}
        # an alternation tries its branches in order: longest first, so a value is masked whole
        self._pattern = re.compile(b"|".join(re.escape(v) for v in spellings)) if spellings else None
        self._keep = max((len(v) for v in spellings), default=1) - 1
        self._spellings = spellings
        self._held = b""

    def _hold_from(self, data: bytes) -> int:
        """Where the bytes that could still begin a spelling start: only a tail that is a prefix of a spelling is
        held (so a live `logs -f` is not kept `longest - 1` bytes behind when nothing secret-like is pending)."""
        for p in range(max(len(data) - self._keep, 0), len(data)):
            tail = data[p:]
            if any(sp.startswith(tail) for sp in self._spellings):
                return p
        return len(data)

    def _take(self, data: bytes, final: bool) -> bytes:
        if self._pattern is None:
            self._held = b""
            return data
        safe = len(data) if final else self._hold_from(data)  # a match starting at or after this may grow
        out, pos = [], 0
        for m in self._pattern.finditer(data):
            if m.start() >= safe:
                break
            out += [data[pos:m.start()], self._labels[m.group()]]
            pos = m.end()
        cut = max(pos, safe)
        out.append(data[pos:cut])
        self._held = data[cut:]
        return b"".join(out)

    def feed(self, chunk: bytes) -> bytes:
        """The masked bytes that are safe to write now."""
        return self._take(self._held + chunk, final=False)

    def flush(self) -> bytes:
        """What is held back, masked (end of the stream)."""
        return self._take(self._held, final=True)


def mask_stream(source: Any, sink: Any, values: Mapping[str, str], chunk: int = 65536) -> int:
    """Pump a binary readable (a pipe) into a binary writable (the platform's log file) through a StreamMasker,
    flushing each chunk so `logs -f` keeps up. Returns the bytes written. Ends at EOF."""
    masker, written = StreamMasker(values), 0
    read = getattr(source, "read1", source.read)
    while True:
        data = read(chunk)
        if not data:
            break
        out = masker.feed(data)
        if out:
            sink.write(out)
            sink.flush()
            written += len(out)
    tail = masker.flush()
    sink.write(tail)
    sink.flush()
    return written + len(tail)
