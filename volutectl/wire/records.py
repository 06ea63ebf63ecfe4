"""Frozen records for the wire: a light stand-in for dataclasses, and their JSON.

`volutectl deliver` builds and reads messages on its hot path, where `dataclasses` would
cost 15 ms (it pulls in `inspect`; measured with -X importtime), about half of deliver's
own start-up. `Record` gives the same shape for the type checker (PEP 681's
dataclass_transform) and, at run time, a small class with no `typing` or `dataclasses`:
its fields are its annotations, in order; a field with a class attribute has that
default; instances are frozen, compared and shown by their fields.

`to_wire()` is the record's JSON object (plus its class's constant WIRE fields, less
its QUIET ones at their defaults);
`from_wire()` builds one from JSON by the declared field types, a WireError (76) naming
the field for anything that does not fit.
"""

from __future__ import annotations

from enum import Enum

from volutectl.errors import EX_PROTOCOL, VoluteError

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: no `typing` import at run time
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, ClassVar, Self, TypeVar, cast, dataclass_transform
    from typing import Generic as Replying

    ReplyT = TypeVar("ReplyT", bound="Record", covariant=True)
    A = TypeVar("A", bound="Record")
    M = TypeVar("M", bound="Message[Any]")
    S = TypeVar("S")  # what a handler acts on (the gate's state, the launcher)
    C = TypeVar("C")  # what else a handler is given (who sent it, a payload)
else:

    def dataclass_transform(**_options: object) -> object:
        return lambda cls: cls

    class _Asking:
        """`Message[SomeReply]` at run time: a base that is the message class itself,
        and remembers the reply it names (for `Message.answer`)."""

        def __init__(self, cls: type, reply: object) -> None:
            self.cls, self.reply = cls, reply

        def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type]:
            return (self.cls,)

        def __or__(self, other: object) -> object:  # in a type alias: `Request[R] | X`
            return self.cls | other

        def __ror__(self, other: object) -> object:
            return other | self.cls

    class Replying:
        """`Request[SomeReply]` is `Request` itself at run time (`typing.Generic` would
        cost `volutectl deliver` its import); the reply it names is kept as ANSWER."""

        def __class_getitem__(cls, reply: object) -> object:
            return _Asking(cls, reply)

    ReplyT = None

    def cast(_kind: object, value: object) -> object:
        return value


class WireError(VoluteError):
    """A message from the other end that does not fit its type (exit 76)."""

    exit_code = EX_PROTOCOL


_RECORDS: dict[str, type[Record]] = {}
_ENUMS: dict[str, type[Enum]] = {}


def register_enum(enum: type[Enum]) -> None:
    """Let fields be declared with `enum`'s type (by its name, as annotations are text)."""
    _ENUMS[enum.__name__] = enum


@dataclass_transform(frozen_default=True)
class Record:
    """A frozen record: see the module's docstring."""

    FIELDS: ClassVar[tuple[str, ...]] = ()
    TYPES: ClassVar[dict[str, str]] = {}
    WIRE: ClassVar[dict[str, object]] = {}
    # Fields sent only when they differ from their default: ones added to a message
    # after its first version, which a peer that knows them reads as that default.
    QUIET: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls) -> None:
        own = {
            name: str(kind)
            for name, kind in cls.__dict__.get("__annotations__", {}).items()
            if not name.isupper()
        }
        cls.TYPES = {**cls.TYPES, **own}
        cls.FIELDS = tuple(cls.TYPES)
        _RECORDS[cls.__name__] = cls

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(self.FIELDS):
            raise TypeError(f"{type(self).__name__} takes {len(self.FIELDS)} fields")
        values = dict(zip(self.FIELDS, args, strict=False))
        for name, value in kwargs.items():
            if name not in self.TYPES or name in values:
                raise TypeError(f"{type(self).__name__}: unexpected or repeated field {name}")
            values[name] = value
        for name in self.FIELDS:
            if name in values:
                object.__setattr__(self, name, values[name])
            elif not hasattr(type(self), name):
                raise TypeError(f"{type(self).__name__}: missing field {name}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._values()))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)
        return f"{type(self).__name__}({fields})"

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = dict(self.WIRE)
        for name in self.FIELDS:
            value = getattr(self, name)
            if name not in self.QUIET or value != getattr(type(self), name):
                wire[name] = _to_wire(value)
        return wire

    @classmethod
    def from_wire(cls, obj: object, where: str = "") -> Self:
        """Decode by the declared field types (replies); requests override this."""
        if not isinstance(obj, dict):
            raise WireError(f"{where or cls.__name__}: expected an object, not {kind_of(obj)}")
        values = {}
        for name in cls.FIELDS:
            if name in obj:
                values[name] = _decode(cls.TYPES[name], obj[name], _path(where, name))
            elif not hasattr(cls, name):
                raise WireError(f"{_path(where, name)}: missing from {cls.__name__}")
        return cls(**values)


class Message(Record, Replying[ReplyT]):
    """A record that asks for a reply: a request on the gate's socket
    (volutectl/wire/messages.py) or an order on the launcher's (volutectl/wire/orders.py).
    `Message[SomeReply]` declares the reply that answers it, for the type checker and, as
    `answer()`, at run time; a refusal (each side has its own) may answer any."""

    ANSWER: ClassVar[object] = None  # set by `Message[SomeReply]`: a class or its name

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        for base in cls.__dict__.get("__orig_bases__", ()):
            reply = getattr(base, "reply", None)
            if reply is not None:
                cls.ANSWER = reply  # a class, or its name (a forward reference)

    @classmethod
    def answer(cls: type[Message[A]]) -> type[A]:
        """The reply type declared as `Message[ThatReply]`."""
        reply = cls.ANSWER
        found = _RECORDS.get(reply) if isinstance(reply, str) else reply
        if not (isinstance(found, type) and issubclass(found, Record)):
            raise TypeError(f"{cls.__name__} declares no reply")  # pragma: no cover - a bug
        return cast("type[A]", found)

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> Self:
        """The message from its JSON object (fields checked as each side requires)."""
        return cls()

    @classmethod
    def answered_by(
        cls: type[M], handler: Callable[[S, M, C], ReplyT]
    ) -> tuple[type[M], Callable[[S, Any, C], ReplyT]]:
        """This message type and its handler, as an entry of a table keyed by type. The
        type checker proves that the handler takes this message and returns this
        message's reply; the table then holds it for messages of this type alone."""
        return cls, handler


def _to_wire(value: object) -> object:
    if isinstance(value, Record):
        return value.to_wire()
    if isinstance(value, tuple | list):
        return [_to_wire(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _to_wire(item) for key, item in value.items()}
    if isinstance(value, Enum):
        return value.value
    return value


def _path(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def kind_of(value: object) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


_SCALARS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (float, int),
    "bool": (bool,),
}


def _decode(kind: str, value: object, where: str) -> object:
    """`value` as the declared type `kind` (an annotation, as text)."""
    kind = kind.strip()
    if kind.endswith("| None"):
        return None if value is None else _decode(kind[: -len("| None")], value, where)
    if kind.startswith("tuple[") and kind.endswith(", ...]"):
        if not isinstance(value, list):
            raise WireError(f"{where}: expected an array, not {kind_of(value)}")
        inner = kind[len("tuple[") : -len(", ...]")]
        return tuple(_decode(inner, item, f"{where}[{i}]") for i, item in enumerate(value))
    if kind.startswith("dict[str, ") and kind.endswith("]"):
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected an object, not {kind_of(value)}")
        inner = kind[len("dict[str, ") : -1]
        return {str(k): _decode(inner, item, _path(where, str(k))) for k, item in value.items()}
    if kind in _SCALARS:
        if not isinstance(value, _SCALARS[kind]) or (kind != "bool" and type(value) is bool):
            raise WireError(f"{where}: expected {kind}, not {kind_of(value)}")
        return float(value) if kind == "float" and isinstance(value, int) else value
    if kind in _ENUMS:
        try:
            return _ENUMS[kind](value)
        except ValueError:
            if isinstance(value, str):
                # A newer gate's state, reason or outcome: kept as text, so that adding
                # one is not an incompatible change for older clients.
                return value
            raise WireError(f"{where}: {value!r} is not a {kind}") from None
    if kind in _RECORDS:
        return _RECORDS[kind].from_wire(value, where)
    raise TypeError(f"messages: no decoder for the type {kind!r} of {where}")
