"""Typed message bodies: ``def handle(self, order: Order, ctx)``.

When the message parameter of ``handle`` (or the element type of ``handle_batch``'s
``Sequence[...]``) is annotated with a pydantic v2 model, a dataclass or a msgspec
``Struct``, the pipeline decodes the body as JSON and validates it before the handler
runs; the handler receives the validated object and ``ctx.message`` the raw
:class:`~mqdedup.message.Message`. The annotation is read once per consumer class
(:func:`body_decoder`, cached), with :func:`typing.get_type_hints`.

A body that does not validate raises :class:`InvalidBodyError` (a
:class:`~mqdedup.errors.MessageError`): the message is dead-lettered at once, never
retried, and the reason lists each field path with its error, e.g.
``invalid body for Order: items[0].qty: Input should be a valid integer; customer: Field
required``. A body sent with a content type that is not JSON (the Kafka ``content-type``
header, the AMQP ``content_type`` property) is refused the same way.

Unannotated handlers, and handlers annotated with ``Message`` (or ``Any``), get the raw
message as before: no decoder, one ``is None`` test per message.

pydantic (``pip install 'mqdedup[pydantic]'``) and msgspec (``mqdedup[msgspec]``) are
never imported here: a model of theirs is recognised through the already imported
package. Dataclasses need nothing: :func:`dataclass_decoder` checks JSON types against
the field annotations (str, int, float, bool, None, unions and ``Optional``,
``Literal``, enums, lists, tuples, sets, dicts with string keys, nested dataclasses,
``datetime`` / ``date`` / ``time`` / ``UUID`` / ``Decimal`` from strings); unknown keys
are ignored, as pydantic and msgspec do by default.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import functools
import inspect
import json
import re
import sys
import types
import typing
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from mqdedup.errors import ConfigurationError, UndecodableMessageError
from mqdedup.message import Message

__all__ = ["BodyDecoder", "InvalidBodiesError", "InvalidBodyError", "body_decoder"]

#: Decodes and validates one message's body (raises InvalidBodyError).
BodyDecoder = Callable[[Message], Any]

#: Errors listed in a dead-letter reason; the rest are counted.
MAX_LISTED_ERRORS = 20


class InvalidBodyError(UndecodableMessageError):
    """The body does not decode into the handler's annotated type.

    ``errors`` holds ``(field path, error)`` pairs (path ``body`` for the whole body);
    ``reason`` lists them: ``invalid body for Order: items[0].qty: ...; customer: ...``.
    The message is dead-lettered at once, never retried.
    """

    def __init__(self, type_name: str, errors: Sequence[tuple[str, str]]) -> None:
        self.type_name = type_name
        self.errors = list(errors)
        listed = "; ".join(f"{path}: {text}" for path, text in self.errors[:MAX_LISTED_ERRORS])
        more = len(self.errors) - MAX_LISTED_ERRORS
        if more > 0:
            listed += f"; and {more} more"
        super().__init__(f"invalid body for {type_name}: {listed}")


class InvalidBodiesError(Exception):
    """Some messages of a batch have invalid bodies (``failed``: each delivery-like
    item with its :class:`InvalidBodyError`): the batch runs again without them, and
    they are dead-lettered alone."""

    def __init__(self, failed: list[tuple[Any, InvalidBodyError]]) -> None:
        super().__init__(f"{len(failed)} message(s) of the batch have invalid bodies")
        self.failed = failed


# -- finding the annotation -----------------------------------------------------------------


def body_decoder(consumer_class: type, method: str) -> BodyDecoder | None:
    """The decoder for ``consumer_class.method``'s message parameter, or None (raw).

    ``method``: ``"handle"`` (the parameter's type) or ``"handle_batch"`` (the element
    type of its ``Sequence[...]``). Cached per class; raises ConfigurationError for an
    annotation that names no supported type.
    """
    return _decoder(consumer_class, method)


@functools.cache
def _decoder(consumer_class: type, method: str) -> BodyDecoder | None:
    function = getattr(consumer_class, method, None)
    if function is None:
        return None
    function = inspect.unwrap(function)
    where = f"{consumer_class.__name__}.{method}"
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    if len(parameters) < 2:
        return None
    parameter = parameters[1]  # (self, message, ctx)
    raw = parameter.annotation
    if raw is inspect.Parameter.empty:
        return None
    try:
        annotation = _resolve(function, parameter.name, raw)
    except Exception as error:  # NameError: a name imported under TYPE_CHECKING
        if isinstance(raw, str) and raw.strip("'\" ").rsplit(".", 1)[-1] in _RAW_NAMES:
            return None
        raise ConfigurationError(
            f"{where}: cannot resolve the annotation {raw!r} of {parameter.name!r} "
            f"({type(error).__name__}: {error}); import its type at module level"
        ) from None
    if method == "handle_batch":
        annotation = _element_type(annotation, where)
        if annotation is None:
            return None
    return decoder_for(annotation, where)


def _resolve(function: Any, name: str, raw: Any) -> Any:
    """The type of one parameter; only its own annotation must resolve (``ctx: Context``
    imported under ``TYPE_CHECKING`` is fine)."""

    def alone() -> None: ...

    alone.__annotations__ = {name: raw}
    return typing.get_type_hints(alone, globalns=getattr(function, "__globals__", None))[name]


_RAW_NAMES = {"Message", "Any", "object", "Sequence[Message]", "list[Message]"}


def _element_type(annotation: Any, where: str) -> Any:
    """``Order`` of ``Sequence[Order]`` / ``list[Order]``; None for raw messages."""
    if annotation in (Any, object):
        return None
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, Sequence, Iterable, typing.Sequence, typing.Iterable):
        arguments = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return arguments[0] if arguments else None
    if origin is None and annotation in (list, tuple, Sequence, Iterable):
        return None
    raise ConfigurationError(
        f"{where}: annotate the messages as Sequence[Model] (or Sequence[Message]), "
        f"not {annotation!r}"
    )


def decoder_for(annotation: Any, where: str = "the handler") -> BodyDecoder | None:
    """The decoder of one annotated type (None: the handler takes the raw Message)."""
    if annotation in (Message, Any, object):
        return None
    if isinstance(annotation, type):
        pydantic = sys.modules.get("pydantic")
        if pydantic is not None and issubclass(annotation, pydantic.BaseModel):
            return _pydantic_decoder(annotation)
        msgspec = sys.modules.get("msgspec")
        if msgspec is not None and issubclass(annotation, msgspec.Struct):
            return _msgspec_decoder(annotation)
        if dataclasses.is_dataclass(annotation):
            return dataclass_decoder(annotation)
    raise ConfigurationError(
        f"{where}: the message parameter is annotated {annotation!r}; annotate it with a "
        "pydantic model, a dataclass or a msgspec Struct (the body is decoded into it), "
        "or with mqdedup.Message (the raw message)"
    )


# -- content type -------------------------------------------------------------------------


def _content_type(message: Message) -> str | None:
    value = message.properties.get("content_type") if message.properties else None
    if value is None and message.headers:
        value = message.headers.get("content-type")
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
    return None if value is None else str(value)


def _check_content_type(message: Message, type_name: str) -> None:
    content_type = _content_type(message)
    if content_type and "json" not in content_type.lower():  # FastStream sends "" for none
        raise InvalidBodyError(type_name, [("body", f"content type {content_type!r} is not JSON")])


# -- pydantic ----------------------------------------------------------------------------------


def _pydantic_decoder(model: type) -> BodyDecoder:
    from pydantic import ValidationError  # loaded: the model's class derives from it

    validate = model.model_validate_json  # type: ignore[attr-defined]
    name = model.__name__

    def decode(message: Message) -> Any:
        if message.properties or message.headers:
            _check_content_type(message, name)
        try:
            return validate(message.body)
        except ValidationError as error:
            raise InvalidBodyError(
                name, [(_path(e["loc"]), e["msg"]) for e in error.errors(include_url=False)]
            ) from None

    return decode


def _path(location: Iterable[Any]) -> str:
    """``items[0].qty`` of a location ``("items", 0, "qty")``; ``body`` for ``()``."""
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "body"


# -- msgspec -----------------------------------------------------------------------------------


def _msgspec_decoder(struct: type) -> BodyDecoder:
    import msgspec  # loaded: the Struct derives from it

    decoder: Any = msgspec.json.Decoder(struct)
    name = struct.__name__

    def decode(message: Message) -> Any:
        if message.properties or message.headers:
            _check_content_type(message, name)
        try:
            return decoder.decode(message.body)
        except msgspec.ValidationError as error:
            raise InvalidBodyError(name, [_msgspec_error(str(error))]) from None
        except msgspec.DecodeError as error:
            raise InvalidBodyError(name, [("body", f"invalid JSON: {error}")]) from None

    return decode


def _msgspec_error(text: str) -> tuple[str, str]:
    """``("items[0].qty", "Expected `int`, got `str`")`` of msgspec's
    ``Expected `int`, got `str` - at `$.items[0].qty```."""
    message, separator, at = text.rpartition(" - at `")
    path = at.rstrip("`") if separator else "$"
    if not separator:
        message = text
    path = path[2:] if path.startswith("$.") else path.lstrip("$")
    missing = _MISSING_FIELD.fullmatch(message)
    if missing:  # the path of the missing field itself, as the others give it
        return _join(path, missing.group(1)), "Object missing required field"
    return path or "body", message


_MISSING_FIELD = re.compile(r"Object missing required field `(.+)`")


# -- dataclasses ---------------------------------------------------------------------------------

_INVALID = object()  # a value that failed: its error is in the list already

#: (value, path, errors) -> the converted value or _INVALID
_Convert = Callable[[Any, str, list[tuple[str, str]]], Any]


def dataclass_decoder(cls: type) -> BodyDecoder:
    """The decoder of a dataclass: JSON, then each field checked against its type."""
    convert = _converter(cls)
    name = cls.__name__

    def decode(message: Message) -> Any:
        if message.properties or message.headers:
            _check_content_type(message, name)
        try:
            data = json.loads(message.body)
        except (UnicodeDecodeError, ValueError) as error:
            raise InvalidBodyError(name, [("body", f"invalid JSON: {error}")]) from None
        except RecursionError:
            raise InvalidBodyError(name, [("body", "JSON nested too deeply")]) from None
        errors: list[tuple[str, str]] = []
        value = convert(data, "", errors)
        if errors:
            raise InvalidBodyError(name, errors)
        return value

    return decode


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _fail(path: str, text: str, errors: list[tuple[str, str]]) -> Any:
    errors.append((path or "body", text))
    return _INVALID


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
        type(value), "array" if isinstance(value, list) else "object"
    )


@functools.cache
def _converter(tp: Any) -> _Convert:
    """The converter of one type (built once per type, recursively)."""
    if tp in (Any, object):
        return lambda value, path, errors: value
    if tp is None or tp is type(None):
        return _expect(lambda v: v is None, "null")
    if tp is bool:
        return _expect(lambda v: v is True or v is False, "a boolean")
    if tp is int:
        return _expect(lambda v: type(v) is int, "an integer")
    if tp is float:

        def to_float(value: Any, path: str, errors: list[tuple[str, str]]) -> Any:
            if type(value) in (int, float):
                return float(value)
            return _fail(path, f"expected a number, got {_kind(value)}", errors)

        return to_float
    if tp is str:
        return _expect(lambda v: type(v) is str, "a string")
    if tp in _PARSED:
        return _parsed(tp)
    origin = typing.get_origin(tp)
    arguments = typing.get_args(tp)
    if origin is typing.Annotated:
        return _converter(arguments[0])
    if origin in (typing.Union, types.UnionType):
        return _union(arguments)
    if origin is typing.Literal:
        allowed = arguments
        return _expect(
            lambda v: any(v == a and type(v) is type(a) for a in allowed),
            "one of " + ", ".join(repr(a) for a in allowed),
        )
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass(tp)
    if origin in (list, set, frozenset, Sequence, typing.Sequence) or (
        origin is tuple and len(arguments) == 2 and arguments[1] is Ellipsis
    ):
        return _array(_converter(arguments[0] if arguments else Any), origin)
    if origin is tuple:
        return _fixed_tuple(tuple(_converter(a) for a in arguments))
    if origin in (dict, Mapping, typing.Mapping):
        key_type = arguments[0] if arguments else str
        if key_type not in (str, Any):
            raise ConfigurationError(f"dataclass body field type {tp!r}: JSON keys are strings")
        return _object(_converter(arguments[1] if arguments else Any))
    if tp in (list, dict, tuple, set):
        return _converter(tp[Any] if tp is not dict else dict[str, Any])
    raise ConfigurationError(
        f"dataclass body field type {tp!r} is not supported: use JSON types, dataclasses, "
        "enums, Literal, datetime / date / time / UUID / Decimal, or a pydantic model"
    )


def _expect(check: Callable[[Any], bool], expected: str) -> _Convert:
    def convert(value: Any, path: str, errors: list[tuple[str, str]]) -> Any:
        if check(value):
            return value
        return _fail(path, f"expected {expected}, got {_kind(value)}", errors)

    return convert


_PARSED: dict[Any, Callable[[Any], Any]] = {
    dt.datetime: dt.datetime.fromisoformat,
    dt.date: dt.date.fromisoformat,
    dt.time: dt.time.fromisoformat,
    uuid.UUID: uuid.UUID,
    Decimal: Decimal,
}


def _parsed(tp: Any) -> _Convert:
    parse = _PARSED[tp]
    name = tp.__name__

    def convert(value: Any, path: str, errors: list[tuple[str, str]]) -> Any:
        if type(value) is str or (tp is Decimal and type(value) in (int, float)):
            try:
                return parse(str(value) if tp is Decimal else value)
            except (ValueError, InvalidOperation) as error:
                return _fail(path, f"invalid {name}: {error or value!r}", errors)
        return _fail(path, f"expected a {name} string, got {_kind(value)}", errors)

    return convert


def _union(arguments: tuple[Any, ...]) -> _Convert:
    options = [_converter(a) for a in arguments]
    expected = " | ".join(getattr(a, "__name__", repr(a)) for a in arguments)

    def convert(value: Any, path: str, errors: list[tuple[str, str]]) -> Any:
        if value is None and type(None) in arguments:
            return None
        for option in options:
            tried: list[tuple[str, str]] = []
            result = option(value, path, tried)
            if not tried:
                return result
        return _fail(path, f"expected {expected}, got {_kind(value)}", errors)

    return convert


def _enum(tp: type[enum.Enum]) -> _Convert:
    def convert(value: Any, path: str, errors: list[tuple[str, str]]) -> Any:
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            return _fail(path, f"expected one of {allowed}, got {value!r:.40}", errors)

    return convert


def _array(item: _Convert, origin: Any) -> _Convert:
    build: Callable[[list[Any]], Any] = (
        set
        if origin is set
        else frozenset
        if origin is frozenset
        else tuple
        if origin is tuple
        else list
    )

    def convert(value: Any, path: str, errors: list[tuple[str, str]]) -> Any:
        if type(value) is not list:
            return _fail(path, f"expected an array, got {_kind(value)}", errors)
        before = len(errors)
        items = [item(element, _join(path, index), errors) for index, element in enumerate(value)]
        return _INVALID if len(errors) > before else build(items)

    return convert


def _fixed_tuple(items: tuple[_Convert, ...]) -> _Convert:
    def convert(value: Any, path: str, errors: list[tuple[str, str]]) -> Any:
        if type(value) is not list or len(value) != len(items):
            return _fail(path, f"expected an array of {len(items)} items", errors)
        before = len(errors)
        result = tuple(
            c(v, _join(path, i), errors) for i, (c, v) in enumerate(zip(items, value, strict=True))
        )
        return _INVALID if len(errors) > before else result

    return convert


def _object(item: _Convert) -> _Convert:
    def convert(value: Any, path: str, errors: list[tuple[str, str]]) -> Any:
        if type(value) is not dict:
            return _fail(path, f"expected an object, got {_kind(value)}", errors)
        before = len(errors)
        result = {key: item(element, _join(path, key), errors) for key, element in value.items()}
        return _INVALID if len(errors) > before else result

    return convert


def _dataclass(cls: type) -> _Convert:
    hints = typing.get_type_hints(cls)
    fields = [
        (
            field.name,
            _converter(hints.get(field.name, Any)),
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING,
        )
        for field in dataclasses.fields(cls)
        if field.init
    ]

    def convert(value: Any, path: str, errors: list[tuple[str, str]]) -> Any:
        if type(value) is not dict:
            return _fail(path, f"expected an object, got {_kind(value)}", errors)
        before = len(errors)
        arguments = {}
        for name, field_convert, required in fields:
            if name in value:
                arguments[name] = field_convert(value[name], _join(path, name), errors)
            elif required:
                _fail(_join(path, name), "field required", errors)
        if len(errors) > before:
            return _INVALID
        try:
            return cls(**arguments)
        except (TypeError, ValueError) as error:  # the dataclass's own __post_init__ checks
            return _fail(path, f"{type(error).__name__}: {error}", errors)

    return convert
