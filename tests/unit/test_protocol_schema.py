"""docs/protocol.schema.json against the message classes of volutectl/wire/messages.py.

Programs that are not Python (volute's own daemon is TypeScript) read the JSON Schemas
and docs/protocol.md; the gate and volutectl read the record classes. These tests hold
the two together:
- every request, reply and nested record class has a definition, and every definition
  a class: its properties are the class's fields plus "v" and its constant fields
  (op, ok, event, each a `const`), its required fields those without a default, its
  defaults the class's, and each property's JSON type the field's annotation;
- instances of every class, made at random, validate once on the wire, and requests
  come back from the gate's own decoder unchanged;
- a request the schema rejects (wrong types, missing fields) is refused by the gate's
  decoder too, naming the field, and the other way round, bar one documented leniency;
- every exchange in docs/protocol.md's examples is valid and is what the gate answers.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from tests import protocol_schema as schema
from volutectl import names
from volutectl.errors import EX_DATAERR, EX_PROTOCOL, EX_USAGE, VoluteError
from volutectl.states import AdaptiveMode, HoldReason, LeaseEnd, LeaseState, Outcome, QueueState
from volutectl.wire import messages, protocol
from volutectl.wire.messages import Op, Reply, Request
from volutectl.wire.records import Record

RECORDS: dict[str, type[Record]] = {
    name: value
    for name, value in vars(messages).items()
    if isinstance(value, type)
    and issubclass(value, Record)
    and value.__module__ == messages.__name__
    and value not in (Request, Reply)
}
MESSAGES = {name: cls for name, cls in RECORDS.items() if issubclass(cls, Request | Reply)}
REQUEST_CLASSES = {
    cls.__name__: cls for cls in [*messages.REQUESTS.values(), *messages.MANY.values()]
}
REPLY_CLASSES = {name: cls for name, cls in RECORDS.items() if issubclass(cls, Reply)}
ENUMS = {
    cls.__name__: cls
    for cls in (QueueState, HoldReason, Outcome, AdaptiveMode, LeaseState, LeaseEnd)
}
# Definitions that are no class: the version, the unions, and a shared field type.
HELPERS = {"Version", "Request", "Reply", "Event", "DeliveryIds"}

# The reply each op gets when it is not refused (docs/protocol.md's table says the same).
REPLY_OF = {
    Op.DELIVER: messages.DeliverAck,
    Op.STATUS: messages.StatusReply,
    Op.QUEUE: messages.QueueReply,
    Op.RETRY: messages.ChangedReply,
    Op.DROP: messages.ChangedReply,
    Op.REGISTER_REPO: messages.RegisterReply,
    Op.PING: messages.Pong,
    Op.PAUSE: messages.PauseReply,
    Op.RESUME: messages.PauseReply,
    Op.WAIT: messages.WaitReply,
    Op.ACQUIRE: messages.AcquireReply,
    Op.RELEASE: messages.ReleaseReply,
    Op.CLAIM: messages.ClaimReply,
    Op.END_LEASE: messages.EndLeaseReply,
}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/$defs/{name}"}


def has_default(cls: type[Record], field: str) -> bool:
    return hasattr(cls, field)  # what Record itself asks: a class attribute is a default


def wire(value: object) -> object:
    """A field's default as it is sent (what Record.to_wire does to a field's value)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [wire(item) for item in value]
    return value


# -- every class has its schema, and every schema its class ------------------------------


def test_the_schema_file_is_a_valid_draft_2020_12_schema() -> None:
    doc = schema.document()
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(doc)


def test_every_record_class_has_a_definition_and_every_definition_a_class() -> None:
    defined = set(schema.definitions()) - HELPERS
    assert defined == set(RECORDS) | set(ENUMS), (
        f"classes without a schema: {sorted(set(RECORDS) | set(ENUMS) - defined)}; "
        f"schemas without a class: {sorted(defined - set(RECORDS) - set(ENUMS))}"
    )


def test_the_unions_list_every_request_every_reply_and_every_event() -> None:
    defs = schema.definitions()

    def listed(union: str, key: str) -> set[str]:
        return {item["$ref"].removeprefix("#/$defs/") for item in defs[union][key]}

    events = {cls.__name__ for cls in messages.EVENTS.values()}
    assert listed("Request", "oneOf") == set(REQUEST_CLASSES)
    assert listed("Event", "oneOf") == events
    assert listed("Reply", "anyOf") == set(REPLY_CLASSES) - events | {"Event"}
    assert set(REPLY_OF) == set(Op)


def test_the_version_is_the_protocols() -> None:
    assert schema.definitions()["Version"]["const"] == protocol.VERSION


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_properties_required_fields_and_defaults_are_the_classes(name: str) -> None:
    cls, definition = RECORDS[name], schema.definitions()[name]
    envelope = ["v", *cls.WIRE] if name in MESSAGES else []
    properties = definition["properties"]
    assert definition["type"] == "object"
    assert list(properties) == [*envelope, *cls.FIELDS], "properties differ from the fields"
    required = [*envelope, *(field for field in cls.FIELDS if not has_default(cls, field))]
    assert definition["required"] == required, "a field without a default is required"
    for field in cls.FIELDS:
        if has_default(cls, field):
            assert properties[field].get("default", "<none>") == wire(getattr(cls, field)), field
        else:
            assert "default" not in properties[field], field


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_constant_fields_are_consts_and_the_version_is_required(name: str) -> None:
    cls, properties = MESSAGES[name], schema.definitions()[name]["properties"]
    assert properties["v"] == ref("Version")
    for key, value in cls.WIRE.items():
        assert properties[key] == {"const": value}, key


def kind_of(definition: dict[str, Any]) -> str:
    """A property's schema as the annotation it stands for, e.g. "tuple[int, ...]"."""
    if "$ref" in definition:
        name = definition["$ref"].removeprefix("#/$defs/")
        return kind_of(schema.definitions()[name]) if name in HELPERS else name
    if "anyOf" in definition:
        first, second = definition["anyOf"]
        assert second == {"type": "null"}, definition
        return f"{kind_of(first)} | None"
    kind = definition["type"]
    if isinstance(kind, list):
        assert len(kind) == 2 and kind[1] == "null", definition
        return f"{kind_of({**definition, 'type': kind[0]})} | None"
    if kind == "array":
        return f"tuple[{kind_of(definition['items'])}, ...]"
    if kind == "object":
        return f"dict[str, {kind_of(definition['additionalProperties'])}]"
    return {"string": "str", "integer": "int", "number": "float", "boolean": "bool"}[kind]


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_propertys_json_type_is_its_fields_annotation(name: str) -> None:
    cls, properties = RECORDS[name], schema.definitions()[name]["properties"]
    for field in cls.FIELDS:
        annotation = " ".join(cls.TYPES[field].split())
        assert kind_of(properties[field]) == annotation, field


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_enums_list_exactly_their_members(name: str) -> None:
    definition = schema.definitions()[name]
    assert definition["type"] == "string"
    assert definition["enum"] == [member.value for member in ENUMS[name]]


def test_patterns_and_bounds_are_the_decoders() -> None:
    properties = schema.definitions()["DeliverRequest"]["properties"]
    assert properties["mind"]["pattern"] == f"^{names.MIND_PATTERN.pattern}$"
    assert properties["session"]["pattern"] == f"^{names.SESSION_PATTERN.pattern}$"
    assert properties["request_id"]["pattern"] == f"^{names.REQUEST_ID_PATTERN.pattern}$"
    ids = schema.definitions()["DeliveryIds"]["items"]
    assert (ids["minimum"], ids["maximum"]) == (1, protocol.INT_MAX)
    wait_ids = schema.definitions()["WaitRequest"]["properties"]["ids"]
    assert wait_ids["maxItems"] == messages.MAX_WAIT_IDS
    for op in ("PauseRequest", "ResumeRequest"):
        [names_array, _] = schema.definitions()[op]["properties"]["minds"]["anyOf"]
        assert names_array["items"]["pattern"] == f"^{names.MIND_PATTERN.pattern}$"
    limit = schema.definitions()["QueueRequest"]["properties"]["limit"]
    assert (limit["minimum"], limit["maximum"]) == (1, messages.QUEUE_LIMIT_MAX)


# -- real messages validate --------------------------------------------------------------

TEXT = st.text(max_size=24)
REQUEST_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "mind": st.from_regex(names.MIND_PATTERN, fullmatch=True),
    "session": st.from_regex(names.SESSION_PATTERN, fullmatch=True),
    "request_id": st.none() | st.binary(min_size=16, max_size=16).map(bytes.hex),
    "ids": st.lists(st.integers(1, protocol.INT_MAX), max_size=4).map(tuple),
    "minds": st.none()
    | st.lists(st.from_regex(names.MIND_PATTERN, fullmatch=True), min_size=1, max_size=3).map(
        tuple
    ),
    "path": TEXT.filter(lambda text: "\0" not in text).map(lambda text: "/" + text),
    "limit": st.integers(1, messages.QUEUE_LIMIT_MAX),
    "lease": st.integers(1, protocol.INT_MAX),
    "token": st.binary(min_size=16, max_size=16).map(bytes.hex),
    "pids": st.integers(0, 64),
}


def strategy(kind: str) -> st.SearchStrategy[Any]:
    """Values of the annotation `kind`, as records.py reads annotations."""
    kind = kind.strip()
    if kind.endswith("| None"):
        return st.none() | strategy(kind.removesuffix("| None"))
    if kind.startswith("tuple[") and kind.endswith(", ...]"):
        inner = kind.removeprefix("tuple[").removesuffix(", ...]")
        return st.lists(strategy(inner), max_size=3).map(tuple)
    if kind.startswith("dict[str, "):
        return st.dictionaries(TEXT, strategy(kind.removeprefix("dict[str, ")[:-1]), max_size=3)
    scalars: dict[str, st.SearchStrategy[Any]] = {
        "str": TEXT,
        "int": st.integers(protocol.INT_MIN, protocol.INT_MAX),
        "float": st.floats(allow_nan=False, allow_infinity=False),
        "bool": st.booleans(),
    }
    if kind in scalars:
        return scalars[kind]
    if kind in ENUMS:
        return st.sampled_from(ENUMS[kind])
    return records(RECORDS[kind])


def records(cls: type[Record]) -> st.SearchStrategy[Any]:
    fields = {
        field: REQUEST_FIELDS.get(field, strategy(cls.TYPES[field]))
        if issubclass(cls, Request) or cls is messages.DeliverItem  # a request's part
        else strategy(cls.TYPES[field])
        for field in cls.FIELDS
    }
    return st.fixed_dictionaries(fields).map(lambda values: cls(**values))


@pytest.mark.parametrize("name", sorted(MESSAGES))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_message_validates_as_sent_and_reads_back_the_same(
    name: str, data: st.DataObject
) -> None:
    cls = MESSAGES[name]
    message = data.draw(records(cls))
    line = protocol.encode(message.to_wire())
    received = protocol.decode(line)  # what the other end reads: the version included
    assert schema.problems(name, received) == []
    union = "Request" if issubclass(cls, Request) else "Reply"
    assert schema.problems(union, received) == []
    if issubclass(cls, Request):
        assert messages.decode_request(received) == message
    else:
        assert cls.from_wire(received) == message


# -- what the schema rejects, the gate refuses -------------------------------------------

VALID: dict[str, dict[str, Any]] = {
    "DeliverRequest": {"v": 1, "op": "deliver", "mind": "mimsy", "message": "hi"},
    "DeliverManyRequest": {"v": 1, "op": "deliver", "items": [{"mind": "mimsy", "message": "hi"}]},
    "StatusRequest": {"v": 1, "op": "status"},
    "QueueRequest": {"v": 1, "op": "queue", "states": ["dead"]},
    "RetryRequest": {"v": 1, "op": "retry", "ids": [3]},
    "DropRequest": {"v": 1, "op": "drop", "ids": [3]},
    "RegisterRepoRequest": {"v": 1, "op": "register_repo", "path": "/srv/repo/.git"},
    "PingRequest": {"v": 1, "op": "ping"},
    "PauseRequest": {"v": 1, "op": "pause", "minds": ["mimsy"]},
    "ResumeRequest": {"v": 1, "op": "resume"},
    "WaitRequest": {"v": 1, "op": "wait", "ids": [3, 4]},
    "AcquireRequest": {"v": 1, "op": "acquire", "mind": "mimsy"},
    "ReleaseRequest": {"v": 1, "op": "release", "lease": 7, "token": "ab" * 16},
    "ClaimRequest": {"v": 1, "op": "claim", "lease": 7, "token": "ab" * 16},
    "EndLeaseRequest": {"v": 1, "op": "end_lease", "lease": 7},
}
WRONG: list[object] = [
    None, True, False, 0, 7, -1, 1.5, "", "x", "main", [], ["x"], [0], [2], [1.5], [True],
    {}, {"a": 1},
]  # fmt: skip
# Where the gate takes what the schema does not: a null `states` reads as absent (the
# schema, like the class, says an array; docs/protocol.md tells clients to send one).
LENIENT = {("QueueRequest", "states", "null")}


def gate_reads_line(line: bytes) -> Request[Reply] | VoluteError:
    """What the gate makes of a request line: the typed request, or its refusal."""
    try:
        return messages.decode_request(protocol.decode(line))
    except VoluteError as error:
        return error


def gate_reads(obj: dict[str, Any]) -> Request[Reply] | VoluteError:
    return gate_reads_line(json.dumps(obj).encode())


def probes(name: str) -> list[tuple[str, object, dict[str, Any]]]:
    """(field, value or "<missing>", request) for each wrong value of each field."""
    cls, valid = REQUEST_CLASSES[name], VALID[name]
    out = []
    for field in ["v", "op", *cls.FIELDS]:
        out += [(field, value, {**valid, field: value}) for value in WRONG]
        if field in valid:
            out.append((field, "<missing>", {k: v for k, v in valid.items() if k != field}))
    return out


def test_the_valid_requests_cover_every_request() -> None:
    assert set(VALID) == set(REQUEST_CLASSES)
    for name, obj in VALID.items():
        assert schema.problems(name, obj) == []
        assert isinstance(gate_reads(obj), REQUEST_CLASSES[name])
        # An unknown field is no error to either: a newer client may add an optional one.
        newer = {**obj, "from_the_future": {"x": [1]}}
        assert schema.problems(name, newer) == []
        assert gate_reads(newer) == gate_reads(obj)


@pytest.mark.parametrize("name", sorted(REQUEST_CLASSES))
def test_what_the_schema_rejects_the_gate_refuses_naming_the_field(name: str) -> None:
    disagreements = set()
    for field, value, obj in probes(name):
        valid = schema.is_valid("Request", obj)
        read = gate_reads(obj)
        refused = isinstance(read, VoluteError)
        if valid and not refused:
            continue
        if not valid and refused:
            assert isinstance(read, VoluteError)
            if field == "v":
                assert read.exit_code == EX_PROTOCOL, (value, read.message)
            elif field == "op":
                assert read.exit_code in (EX_USAGE, EX_DATAERR), (value, read.message)
                assert read.message.startswith("op: "), (value, read.message)
            else:
                assert read.exit_code == EX_DATAERR, (field, value, read.message)
                # A deliver without items is a deliver of one: refused for its own mind.
                named = "mind" if (name, field) == ("DeliverManyRequest", "items") else field
                named = field if value != "<missing>" else named
                assert re.match(rf"(invalid )?{named}\b", read.message), (field, read.message)
            continue
        disagreements.add((name, field, json.dumps(value)))
    assert disagreements == {item for item in LENIENT if item[0] == name}


# -- docs/protocol.md's examples ---------------------------------------------------------


def blocks(info: str) -> list[list[str]]:
    """The lines of each ```<info> block of docs/protocol.md (indented ones too)."""
    text = schema.DOC_FILE.read_text()
    found = re.findall(rf"^[ \t]*```{info}\n(.*?)^[ \t]*```", text, flags=re.S | re.M)
    return [[line.strip() for line in block.splitlines() if line.strip()] for block in found]


def is_reply(line: str) -> bool:
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    return isinstance(obj, dict) and "ok" in obj and "op" not in obj


def reply_class(read: Request[Reply], reply: dict[str, Any]) -> type[Reply]:
    """The class a reply to `read` must be: by its ok, its event, or the request's op."""
    if reply["ok"] is False:
        return messages.ErrorReply
    if "event" in reply and reply["event"] in messages.LEASE_EVENTS:
        assert isinstance(read, messages.AcquireRequest | messages.ClaimRequest), reply
        return messages.LEASE_EVENTS[reply["event"]]
    if "event" in reply:
        waits = isinstance(read, messages.WaitRequest)
        assert waits or isinstance(read, messages.DeliverRequest) and read.wait, reply
        return messages.EVENTS[reply["event"]]
    if isinstance(read, messages.DeliverManyRequest):
        return messages.DeliverResults  # the op's other shape: many items
    return REPLY_OF[read.OP]


# Exchanges (```jsonl, valid JSON), and lines the gate refuses as it reads them (```text).
EXCHANGES = [("jsonl", block) for block in blocks("jsonl")] + [
    ("text", block) for block in blocks("text")
]


def example_id(info: str, index: int, block: list[str]) -> str:
    first = json.loads(block[0]).get("op", "?") if info == "jsonl" else block[0][:12]
    return f"{info}{index}-{first}"


def test_the_doc_shows_every_op_every_reply_and_every_event() -> None:
    lines = [line for info, block in EXCHANGES if info == "jsonl" for line in block]
    ops = {json.loads(line).get("op") for line in lines if not is_reply(line)}
    assert ops >= {op.value for op in Op}
    replies = [json.loads(line) for line in lines if is_reply(line)]
    shown = {name for name in REPLY_CLASSES for obj in replies if schema.is_valid(name, obj)}
    assert shown == set(REPLY_CLASSES)


@pytest.mark.parametrize(
    ("info", "block"),
    [pytest.param(*item, id=example_id(*item[:1], n, item[1])) for n, item in enumerate(EXCHANGES)],
)
def test_each_example_is_valid_and_is_what_the_gate_answers(info: str, block: list[str]) -> None:
    """A request line is followed by its replies. Requests and replies in ```jsonl blocks
    validate and show no field their schema lacks; a request the gate's decoder refuses is
    rejected by the schema too (```jsonl) and shown with that very refusal."""
    read: Request[Reply] | VoluteError | None = None
    answered = True
    for line in block:
        if not is_reply(line):
            assert answered, f"a request with no reply shown before {line}"
            read = gate_reads_line(line.encode())
            if info == "jsonl":
                assert schema.is_valid("Request", json.loads(line)) == isinstance(read, Request)
            else:
                assert isinstance(read, VoluteError), f"{line}: the gate takes it"
            answered = False
            continue
        reply = json.loads(line)
        assert read is not None, f"a reply before any request: {line}"
        if isinstance(read, VoluteError):  # refused on arrival: with that very refusal
            assert reply["ok"] is False
            assert (reply["code"], reply["error"]) == (read.exit_code, read.message)
            cls: type[Reply] = messages.ErrorReply
        else:
            cls = reply_class(read, reply)
        assert schema.problems(cls.__name__, reply) == [], line
        assert set(reply) <= set(schema.definitions()[cls.__name__]["properties"]), line
        answered = True
    assert answered, "the last request has no reply shown"


def test_each_schema_quoted_in_the_doc_is_the_schema_files() -> None:
    quoted = [json.loads("\n".join(block)) for block in blocks("json")]
    assert quoted, "the doc quotes no schema"
    for definition in quoted:
        assert definition in schema.definitions().values(), definition.get("description")
