"""What an ``Idempotency-Key``'s request asked for: an unambiguous SHA-256 fingerprint.

A repeat of a key must ask for the same thing as the request that claimed it, else it is
answered 422. The fingerprint covers the method, the path, the query string, the
``Content-Type`` (its media type and parameters; never a multipart boundary) and the
body. Every field is length-prefixed, so no two different requests share a fingerprint
by moving bytes from one field to the next (``/p/a%00b`` with an empty body and
``/p/a?b`` with body ``\\x00`` are two requests).

How the body counts (``mode``):

* ``"bytes"`` (the default): the exact body bytes. Clients must resend the very bytes
  of their first attempt (serialise the body once, keep it for the retries).
* ``"json"``: a JSON body (``application/json``, ``*/*+json``) counts as canonical
  JSON: key order and whitespace do not matter, values do. For clients that serialise
  the body again on each retry. A body that is not valid JSON counts as its bytes.

Whatever the mode, a ``multipart/form-data`` body counts by its parts, in order per
field name: each part's name, file name, (for files) content type and a SHA-256 of its
content. The boundary, which a client picks anew for every attempt, never counts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.message import Message
from email.utils import collapse_rfc2231_value
from typing import Literal

#: How a body counts in the fingerprint (see the module docstring).
FingerprintMode = Literal["bytes", "json"]
FINGERPRINT_MODES: tuple[FingerprintMode, ...] = ("bytes", "json")
_VERSION = b"mqdedup-request-fingerprint-2"


@dataclass(frozen=True, slots=True)
class FormPart:
    """One part of a ``multipart/form-data`` body, as the fingerprint sees it."""

    name: str
    #: None for a plain field, the (possibly empty) file name for a file.
    filename: str | None
    #: SHA-256 of the part's content.
    digest: bytes
    #: The part's media type (files only; empty for plain fields).
    content_type: str = ""

    @classmethod
    def of(
        cls, name: str, content: bytes, filename: str | None = None, content_type: str = ""
    ) -> FormPart:
        """The part named ``name`` with ``content`` (a field, or a file with ``filename``)."""
        kept = media_type(content_type) if filename is not None else ""
        return cls(name, filename, hashlib.sha256(content).digest(), kept)


def check_mode(mode: str) -> FingerprintMode:
    """``mode`` if it is one of :data:`FINGERPRINT_MODES`, else a ValueError naming them."""
    if mode not in FINGERPRINT_MODES:
        raise ValueError(f"fingerprint={mode!r}: use one of {', '.join(FINGERPRINT_MODES)}")
    return mode


def media_type(content_type: str) -> str:
    """The lower-case ``type/subtype`` of a ``Content-Type`` value (no parameters)."""
    return content_type.split(";", 1)[0].strip().lower()


def content_type_params(content_type: str) -> dict[str, str]:
    """The parameters of a ``Content-Type`` value (names lower case, quotes removed)."""
    header = Message()
    header["content-type"] = content_type
    params = header.get_params(header="content-type", failobj=[])
    return {str(name).lower(): str(value) for name, value in params[1:]}


def is_form(content_type: str) -> bool:
    """True for a ``multipart/form-data`` body."""
    return media_type(content_type) == "multipart/form-data"


def request_fingerprint(
    method: str,
    path: str,
    body: bytes,
    query: str = "",
    content_type: str = "",
    *,
    mode: FingerprintMode = "bytes",
) -> str:
    """The fingerprint of a request whose body is at hand as bytes.

    A ``multipart/form-data`` body is split into its parts (:func:`parse_form`); one that
    does not parse counts as its bytes.
    """
    if is_form(content_type):
        boundary = content_type_params(content_type).get("boundary")
        parts = parse_form(body, boundary) if boundary else None
        if parts is not None:
            return form_fingerprint(method, path, parts, query, content_type)
    kind, counted = b"bytes", body
    if mode == "json" and _is_json(content_type):
        canonical = _canonical_json(body)
        if canonical is not None:
            kind, counted = b"json", canonical
    return _digest(_head(method, path, query, content_type), [kind, counted])


def form_fingerprint(
    method: str, path: str, parts: Iterable[FormPart], query: str = "", content_type: str = ""
) -> str:
    """The fingerprint of a ``multipart/form-data`` request from its parts.

    The parts are ordered by field name (keeping the order of one name's values), so a
    framework that hands fields and files over separately (Django's ``request.POST`` and
    ``request.FILES``) counts the same request as one that reads the body in order.
    """
    fields: list[bytes] = [b"form"]
    for part in sorted(parts, key=lambda part: part.name):
        fields += [
            part.name.encode("utf-8", "surrogateescape"),
            b"file" if part.filename is not None else b"field",
            (part.filename or "").encode("utf-8", "surrogateescape"),
            part.content_type.encode("utf-8", "surrogateescape"),
            part.digest,
        ]
    return _digest(_head(method, path, query, content_type), fields)


def parse_form(body: bytes, boundary: str) -> list[FormPart] | None:
    """The parts of a ``multipart/form-data`` body (RFC 7578), None if it is malformed."""
    delimiter = b"\r\n--" + boundary.encode("latin-1", "replace")
    sections = (b"\r\n" + body).split(delimiter)
    parts: list[FormPart] = []
    for section in sections[1:]:
        if section.startswith(b"--"):  # the close delimiter
            return parts
        line_end = section.find(b"\r\n")
        if line_end < 0 or section[:line_end].strip(b" \t"):
            return None
        rest = section[line_end + 2 :]
        if rest.startswith(b"\r\n"):  # no header lines (then no name: malformed below)
            head, content = b"", rest[2:]
        else:
            head, separator, content = rest.partition(b"\r\n\r\n")
            if not separator:
                return None
        part = _form_part(head, content)
        if part is None:
            return None
        parts.append(part)
    return None  # no close delimiter


def _form_part(head: bytes, content: bytes) -> FormPart | None:
    headers = Message()
    for line in head.decode("utf-8", "surrogateescape").split("\r\n") if head else ():
        field, colon, value = line.partition(":")
        if not colon:
            return None
        headers[field.strip()] = value.strip()
    found = headers.get_param("name", header="content-disposition")
    if found is None:
        return None
    name = collapse_rfc2231_value(found)
    filename = headers.get_filename()
    return FormPart.of(name, content, filename, str(headers.get("content-type", "")))


def _is_json(content_type: str) -> bool:
    media = media_type(content_type)
    return media == "application/json" or media.endswith("+json")


def _canonical_json(body: bytes) -> bytes | None:
    try:
        value = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8: counted as bytes
        return None
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )


def _head(method: str, path: str, query: str, content_type: str) -> list[bytes]:
    """The request line and content type fields (a multipart boundary left out)."""
    media = media_type(content_type)
    params = sorted(
        (name, value)
        for name, value in content_type_params(content_type).items()
        if name != "boundary"
    )
    kept = ";".join([media, *(f"{name}={value}" for name, value in params)])
    return [
        method.upper().encode(),
        path.encode("utf-8", "surrogateescape"),
        query.encode("utf-8", "surrogateescape"),
        kept.encode("utf-8", "surrogateescape"),
    ]


def _digest(head: Sequence[bytes], body: Sequence[bytes]) -> str:
    """SHA-256 over length-prefixed fields: no field can run into the next one."""
    digest = hashlib.sha256(_VERSION)
    for part in (*head, *body):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()
