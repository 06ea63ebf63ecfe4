"""A client with no volutectl code in it drives the real gate, as docs/protocol.md says.

RAW_CLIENT is what a program in another language would write: a Unix socket, JSON lines,
nothing else. It runs inside the container under `python -I -S` (no site-packages, so
it could not import volutectl if it tried), as an unprivileged member of the group
volute, against the socket that systemd holds for the real volute-gate.service. Every
line the gate answers is checked against docs/protocol.schema.json.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests import protocol_schema as schema
from volute_testbed.gate import DEFAULT_SOCKET, gate_config, start_gate
from volute_testbed.machine import Machine
from volute_testbed.paths import PYTHON

pytestmark = pytest.mark.system

# One connection: for each [line, n] read from stdin, send the line and read n replies.
RAW_CLIENT = r"""
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(60)
sock.connect(sys.argv[1])
replies = sock.makefile("rb")
transcript = []
for line, count in json.load(sys.stdin):
    sock.sendall(line.encode() + b"\n")
    transcript.append([json.loads(replies.readline()) for _ in range(count)])
print(json.dumps(transcript))
"""


def converse(machine: Machine, steps: list[tuple[str, int]], user: str) -> list[list[Any]]:
    """One connection as `user`: each step's replies, in order."""
    proc = machine.run(
        [PYTHON, "-I", "-S", "-c", RAW_CLIENT, DEFAULT_SOCKET],
        input=json.dumps(steps),
        user=user,
    )
    transcript: list[list[Any]] = json.loads(proc.stdout)
    assert len(transcript) == len(steps)
    return transcript


def line(**fields: object) -> str:
    return json.dumps({"v": 1, **fields})


def valid(name: str, reply: dict[str, Any]) -> dict[str, Any]:
    assert schema.problems(name, reply) == [], reply
    assert schema.is_valid("Reply", reply)
    return reply


def test_a_raw_socket_client_in_the_volute_group_speaks_the_documented_protocol(
    machine: Machine,
) -> None:
    start_gate(machine, gate_config({"mimsy": "true", "whorl": "exit 3"}, gate={"max_attempts": 1}))
    machine.run(["useradd", "-M", "-G", "volute", "agent"])  # a member of the socket's group
    machine.run(["useradd", "-M", "stranger"])  # not one
    request_id = os.urandom(16).hex()
    deliver = line(op="deliver", mind="mimsy", session="chat", message="hello", wait=True,
                   request_id=request_id)  # fmt: skip
    (
        pong,
        (ack, ended),
        not_boolean,
        not_json,
        unknown_op,
        unknown_mind,
        (dead_ack, dead),
        status,
        queue,
        pong_again,
    ) = converse(
        machine,
        [
            (line(op="ping"), 1),
            (deliver, 2),
            (line(op="deliver", mind="mimsy", message="m", wait="yes"), 1),
            ("deliver mimsy hello", 1),
            (line(op="frobnicate"), 1),
            (line(op="deliver", mind="ghost", message="m"), 1),
            (line(op="deliver", mind="whorl", message="fails", wait=True), 2),
            (line(op="status"), 1),
            (line(op="queue", states=["done", "dead"]), 1),
            (line(op="ping"), 1),
        ],
        user="agent",
    )
    assert valid("Pong", pong[0]) == {"v": 1, "ok": True}
    # The ack, then the event of the turn that carried the delivery, on this connection.
    delivery = valid("DeliverAck", ack)["id"]
    assert valid("TurnEnded", ended)["event"] == "turn_ended"
    assert (ended["id"], ended["outcome"], ended["exit_status"], ended["exit_code"]) == (
        delivery, "ok", 0, 0,
    )  # fmt: skip
    # Malformed requests: each refused with its code, naming the field; the same
    # connection is served afterwards.
    for (reply,), code, start in [
        (not_boolean, 65, "wait: must be true or false, not a string"),
        (not_json, 76, "not a JSON line"),
        (unknown_op, 64, "op: unknown request 'frobnicate'"),
        (unknown_mind, 67, "unknown mind 'ghost'"),
    ]:
        assert valid("ErrorReply", reply)["ok"] is False
        assert (reply["code"], reply["error"][: len(start)]) == (code, start), reply
    assert valid("DeliveryDead", dead) == {
        "v": 1, "ok": True, "event": "dead", "id": valid("DeliverAck", dead_ack)["id"],
        "error": f"turn {dead['turn_id']} exited 3", "exit_code": 3,
        "turn_id": dead["turn_id"], "outcome": "failed",
    }  # fmt: skip
    assert valid("StatusReply", status[0])["status"]["dead"] == 1
    rows = valid("QueueReply", queue[0])["rows"]  # newest first
    assert [(row["id"], row["state"]) for row in rows] == [(dead["id"], "dead"), (delivery, "done")]
    assert queue[0]["not_shown"] == 0
    assert valid("Pong", pong_again[0]) == pong[0]

    # Sent again on a new connection with the same request id (what a client does when it
    # lost its connection before the ack): the original id, marked as queued before, and
    # the event at once.
    [(again, again_ended)] = converse(machine, [(deliver, 2)], user="agent")
    assert valid("DeliverAck", again) == {**ack, "already_queued": True}
    assert valid("TurnEnded", again_ended) == ended

    # The socket is root:volute 0660: a user outside the group cannot connect at all.
    refused = machine.run(
        [PYTHON, "-I", "-S", "-c", RAW_CLIENT, DEFAULT_SOCKET], input="[]", user="stranger",
        check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "PermissionError" in refused.stderr, refused.stderr
