// A lease client in Node, with no volutectl code in it: the protocol's second-language
// check (issue 31). It does what an agent daemon such as volute's does with the gate:
// for each mind, ask for a lease (`acquire`), wait in the gate's FIFO for the grant,
// then run the turn in the mind's resident process (here: one request to that process's
// unix socket, as the daemon would POST to it) and give the lease back (`release`).
// Nothing but node:net, node:crypto and JSON lines, as docs/protocol.md describes them.
//
// Node's net module cannot pass descriptors (SCM_RIGHTS) without a native module, so
// this client holds its leases without pids: the gate's placeholder holds each lease's
// scope, and the resident processes stay where they are.
//
//   node lease_client.mjs PLAN.json
//
// PLAN: {"socket": PATH, "rounds": N, "minds": [{"mind": M, "session": S,
//        "resident": PATH}], "turn_ms": MS}
// Prints one JSON line per lease on stdout: {"mind", "session", "round", "lease",
// "unit", "turn_id", "created", "waited": whether it waited, "granted_at", "released_at",
// "resident": the resident's answer, "grants": how many lease_granted it saw}; exits 0 if
// every lease was granted and released, 64 if the gate is too old for leases, 1 else.

import net from "node:net";
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";

const TOO_OLD = 64;

class GateLine {
  // One connection to the gate: JSON objects out, one per line; lines in, in order.
  constructor(socket) {
    this.socket = socket;
    this.buffer = "";
    this.lines = [];
    this.waiters = [];
    this.closed = false;
    socket.setEncoding("utf8");
    socket.on("data", (chunk) => {
      this.buffer += chunk;
      let end;
      while ((end = this.buffer.indexOf("\n")) >= 0) {
        const line = this.buffer.slice(0, end);
        this.buffer = this.buffer.slice(end + 1);
        this.push(JSON.parse(line));
      }
    });
    const closed = () => {
      this.closed = true;
      for (const waiter of this.waiters.splice(0)) waiter.reject(new Error("the gate closed"));
    };
    socket.on("close", closed);
    socket.on("error", closed);
  }

  static open(path) {
    return new Promise((resolve, reject) => {
      const socket = net.createConnection(path);
      socket.once("connect", () => resolve(new GateLine(socket)));
      socket.once("error", reject);
    });
  }

  push(obj) {
    const waiter = this.waiters.shift();
    if (waiter) waiter.resolve(obj);
    else this.lines.push(obj);
  }

  send(obj) {
    this.socket.write(JSON.stringify({ v: 1, ...obj }) + "\n");
  }

  next() {
    if (this.lines.length) return Promise.resolve(this.lines.shift());
    if (this.closed) return Promise.reject(new Error("the gate closed"));
    return new Promise((resolve, reject) => this.waiters.push({ resolve, reject }));
  }

  close() {
    this.socket.end();
  }
}

class Refused extends Error {
  constructor(reply) {
    super(`${reply.error} (code ${reply.code})`);
    this.code = reply.code;
  }
}

function checked(reply, op) {
  if (reply.v !== 1) throw new Error(`not protocol version 1: ${JSON.stringify(reply)}`);
  if (reply.ok === false) {
    if (reply.code === TOO_OLD && op === "acquire") {
      const error = new Refused(reply);
      error.message = "the gate is too old for leases (upgrade volutectl on the host)";
      throw error;
    }
    throw new Refused(reply);
  }
  return reply;
}

function askResident(path, text) {
  // The turn: one line to the mind's resident process, its one-line answer back.
  return new Promise((resolve, reject) => {
    const socket = net.createConnection(path);
    let answer = "";
    socket.setEncoding("utf8");
    socket.once("connect", () => socket.write(text + "\n"));
    socket.on("data", (chunk) => (answer += chunk));
    socket.once("end", () => resolve(answer.trim()));
    socket.once("error", reject);
  });
}

async function oneLease(plan, target, round) {
  const gate = await GateLine.open(plan.socket);
  try {
    const requestId = randomBytes(16).toString("hex");
    gate.send({ op: "acquire", mind: target.mind, session: target.session, request_id: requestId, pids: 0 });
    const ack = checked(await gate.next(), "acquire");
    // A new acquire's wait has no reason yet (admission looks after the reply); `status`
    // shows it. A join is granted at once.
    const waited = ack.state === "waiting";
    let grant = null;
    let grants = 0;
    while (grant === null) {
      const event = checked(await gate.next(), "acquire");
      if (event.event === "lease_ended" && event.lease === ack.lease) {
        throw new Error(`lease ${ack.lease} ended before its grant: ${event.reason}`);
      }
      if (event.event === "lease_granted" && event.lease === ack.lease) {
        grant = event;
        grants += 1;
      }
    }
    const grantedAt = Date.now() / 1000;
    const resident = await askResident(target.resident, `turn ${round} ${plan.turn_ms ?? 200}`);
    gate.send({ op: "release", lease: grant.lease, token: grant.token });
    let released = null;
    let ended = null;
    while (released === null) {
      const line = await gate.next();
      if (line.ok === false && ended !== null) {
        throw new Error(`lease ${grant.lease} ended while held: ${ended}`);
      }
      const reply = checked(line, "release");
      if (reply.event === "lease_granted" && reply.lease === grant.lease) grants += 1;
      else if (reply.event === "lease_ended" && reply.lease === grant.lease) ended = reply.reason;
      else if (reply.event === undefined) released = reply;
    }
    if (released.released !== true || released.lease !== grant.lease) {
      throw new Error(`release of lease ${grant.lease}: ${JSON.stringify(released)}`);
    }
    return {
      mind: target.mind,
      session: target.session,
      round,
      lease: grant.lease,
      unit: grant.unit,
      turn_id: grant.turn_id,
      created: grant.created,
      waited,
      granted_at: grantedAt,
      released_at: Date.now() / 1000,
      resident,
      grants,
    };
  } finally {
    gate.close();
  }
}

async function main() {
  const plan = JSON.parse(readFileSync(process.argv[2], "utf8"));
  let failed = 0;
  let code = 0;
  await Promise.all(
    plan.minds.map(async (target) => {
      for (let round = 0; round < (plan.rounds ?? 1); round += 1) {
        try {
          process.stdout.write(JSON.stringify(await oneLease(plan, target, round)) + "\n");
        } catch (error) {
          failed += 1;
          if (error.code === TOO_OLD) code = TOO_OLD;
          process.stderr.write(`lease_client: ${target.mind}/${target.session}: ${error.message}\n`);
        }
      }
    }),
  );
  process.exitCode = code || (failed ? 1 : 0);
}

await main();
