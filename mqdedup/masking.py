"""One way to hide secrets in connection URLs, for every message, log line and metric.

:func:`mask_url` handles every URL mqdedup takes (``postgresql://``, ``mysql://``,
``sqlite://``, ``amqp(s)://``, ``redis(s)://``, Kafka bootstrap lists): the user-info
password and every query parameter whose name looks secret (``password``, ``passwd``,
``pwd``, ``secret``, ``token``, ``sslpassword``, ``api_key``, ...) become ``***``.

The user-info ends at the *last* ``@`` of the authority, so an unescaped ``@`` in a
password (``app:pa@ss@host``) is masked whole. When the split is ambiguous (an ``@``
after a ``/`` or ``?``) the whole user-info is masked rather than guessed.

:func:`mask_text` scrubs a free text (a driver's error message, which may echo the
DSN or a piece of it) of the secrets of the given URLs and masks the URLs it contains.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

MASK = "***"
#: A query parameter is secret when its lower-cased name contains one of these.
SECRET_PARAMETER_WORDS = (
    "pass",  # password, passwd, sslpassword, sasl_password, passphrase
    "pwd",
    "secret",
    "token",
    "key",  # api_key, apikey, sslkey (a path, harmless to hide)
    "auth",
    "credential",
    "signature",
)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9_+.\-]*)://")
# A URL in free text ends before white space, quotes, or trailing punctuation.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9_+.\-]*://[^\s'\"<>]*[^\s'\"<>:,.;)\]]")
_AMBIGUOUS_USER = re.compile(r"[/?#&=]")
#: Pieces of a password shorter than this are scrubbed only next to an ``@``.
_MIN_PIECE = 3


def is_secret_parameter(name: str) -> bool:
    """True if a URL query parameter called ``name`` may hold a secret."""
    lowered = unquote(name).lower()
    return any(word in lowered for word in SECRET_PARAMETER_WORDS)


def mask_url(url: Any) -> str:
    """``url`` (a string or a SQLAlchemy ``URL``) with every secret replaced by ``***``.

    Comma-separated lists (Kafka bootstrap servers) are masked element by element.
    """
    text = _as_text(url)
    if _is_list(text):
        return ",".join(_mask_one(part) for part in text.split(","))
    return _mask_one(text)


def url_secrets(url: Any) -> list[str]:
    """The secret values in ``url`` (password, secret query values), raw and decoded."""
    text = _as_text(url)
    found: list[str] = []
    for part in text.split(",") if _is_list(text) else [text]:
        _, userinfo, rest = _split(part)
        ambiguous = userinfo is not None and bool(_AMBIGUOUS_USER.search(userinfo))
        if ambiguous and userinfo is not None:
            found.append(userinfo)
        elif userinfo is not None and ":" in userinfo:
            found.append(userinfo.split(":", 1)[1])
        # With an ambiguous split the last @ may sit inside the query: read all of it.
        query = rest if ambiguous else rest.partition("?")[2].partition("#")[0]
        for pair in re.split(r"[&;?]", query):
            name, sep, value = pair.partition("=")
            if sep and value and is_secret_parameter(name):
                found.append(value)
    return sorted({v for s in found for v in (s, unquote(s)) if v}, key=len, reverse=True)


def mask_text(text: str, *urls: Any) -> str:
    """``text`` with the secrets of ``urls`` scrubbed and any URL in it masked.

    For driver errors that echo a DSN, or a host name made of a password's tail
    (``could not translate host name "ss@db"``).
    """
    for secret in (s for url in urls if url for s in url_secrets(url)):
        text = text.replace(secret, MASK)
        for piece in secret.split("@"):
            if len(piece) >= _MIN_PIECE:
                text = text.replace(piece, MASK)
            elif piece:
                text = text.replace(f"{piece}@", f"{MASK}@").replace(f"@{piece}", f"@{MASK}")
    return _URL_IN_TEXT.sub(lambda match: _mask_one(match.group(0)), text)


def _as_text(url: Any) -> str:
    if url is None:
        return ""
    render = getattr(url, "render_as_string", None)
    if render is not None:  # a SQLAlchemy URL: its query parameters are masked below
        return str(render(hide_password=False))
    return str(url)


def _is_list(text: str) -> bool:
    """A Kafka bootstrap list (``h1:9092,h2:9092``, ``SASL_SSL://u:p@h1,SASL_SSL://…``)."""
    return "," in text and (text.count("://") != 1 or not _SCHEME.match(text))


def _split(text: str) -> tuple[str, str | None, str]:
    """``(scheme://, user-info or None, host and the rest)``; user-info ends at the last @."""
    match = _SCHEME.match(text.strip())
    head = match.group(0) if match else ""
    rest = text.strip()[len(head) :]
    userinfo, at, tail = rest.rpartition("@")
    if not at:
        return head, None, rest
    return head, userinfo, tail


def _mask_one(text: str) -> str:
    head, userinfo, rest = _split(text)
    if userinfo is not None and _AMBIGUOUS_USER.search(userinfo):
        # The last @ may sit in a password or in the query: hide all before it, and
        # read everything after it as query parameters.
        return f"{head}{MASK}@{_mask_query(rest)}"
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        userinfo = f"{user}:{MASK}" if colon else user
    base, question, query = rest.partition("?")
    if question:
        query, hash_, fragment = query.partition("#")
        query = _mask_query(query) + hash_ + fragment
    prefix = head + (f"{userinfo}@" if userinfo is not None else "")
    return prefix + base + question + query


def _mask_query(query: str) -> str:
    pairs = re.split(r"([&;?])", query)
    masked = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        masked.append(f"{name}={MASK}" if sep and value and is_secret_parameter(name) else pair)
    return "".join(masked)
