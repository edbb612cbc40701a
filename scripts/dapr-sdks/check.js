// Dapr's JavaScript SDK, unchanged, against redlock-sidecar (run by scripts/dapr-sdks.sh).
//
// The app is written as for Dapr: `new DaprClient({ communicationProtocol })` finds the
// sidecar from DAPR_HTTP_PORT or DAPR_GRPC_PORT. A second client reaches another sidecar on
// the same Redis nodes, as another pod of the app would.
//
//   node check.js http|grpc CASES      lock, contention, wrong-owner unlock, unlock, expiry, a bad store
//   node check.js http|grpc NOQUORUM   with too few nodes left: an error that says so, unlock status 3
"use strict";

const { DaprClient, CommunicationProtocolEnum, LogLevel } = require("@dapr/dapr");

const [protocolName, mode] = process.argv.slice(2);
const grpc = protocolName === "grpc";
const protocol = grpc ? CommunicationProtocolEnum.GRPC : CommunicationProtocolEnum.HTTP;
const STORE = process.env.STORE || "redlock";
const RUN = Math.random().toString(16).slice(2, 10);
// Dapr's unlock statuses (LockStatus): the same numbers over HTTP and gRPC.
const SUCCESS = 0, DOES_NOT_EXIST = 1, BELONGS_TO_OTHERS = 2, INTERNAL_ERROR = 3;
let passed = 0, failed = 0;

function check(name, ok, detail) {
  if (ok) {
    passed += 1;
    console.log(`ok   js/${protocolName}: ${name}`);
  } else {
    failed += 1;
    console.log(`FAIL js/${protocolName}: ${name} ${detail === undefined ? "" : JSON.stringify(detail)}`);
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function cases(a, b) {
  const order = `js-${protocolName}-order-${RUN}`;
  check("lock: taken", (await a.lock.lock(STORE, order, "alice", 10)).success === true);
  for (const [client, where] of [[a, "this sidecar"], [b, "another sidecar"]]) {
    const held = await client.lock.lock(STORE, order, "bob", 10);
    check(`contention: another owner through ${where} is refused`, held.success === false, held);
  }
  check("contention: no re-entry for the same owner", (await a.lock.lock(STORE, order, "alice", 10)).success === false);
  for (const [client, where] of [[a, "this sidecar"], [b, "another sidecar"]]) {
    const unlocked = await client.lock.unlock(STORE, order, "bob");
    check(`wrong-owner unlock through ${where}: LockBelongsToOthers`, unlocked.status === BELONGS_TO_OTHERS, unlocked);
  }
  check("unlock: Success", (await a.lock.unlock(STORE, order, "alice")).status === SUCCESS);
  check("unlock again: LockDoesNotExist", (await a.lock.unlock(STORE, order, "alice")).status === DOES_NOT_EXIST);
  check("unlock of a lock never taken: LockDoesNotExist", (await b.lock.unlock(STORE, `never-${RUN}`, "alice")).status === DOES_NOT_EXIST);
  check("after the unlock another owner takes it", (await b.lock.lock(STORE, order, "bob", 10)).success === true);
  await b.lock.unlock(STORE, order, "bob");

  const short = `js-${protocolName}-short-${RUN}`;
  check("expiry: taken for 2 s", (await a.lock.lock(STORE, short, "alice", 2)).success === true);
  check("expiry: held before it expires", (await b.lock.lock(STORE, short, "bob", 2)).success === false);
  const began = Date.now();
  while (!(await b.lock.lock(STORE, short, "bob", 2)).success && Date.now() - began < 6000) {
    await sleep(200);
  }
  const waited = (Date.now() - began) / 1000;
  check("expiry: another owner takes it once it expired", waited > 1 && waited < 6, `after ${waited} s`);

  try {
    await a.lock.lock("no-such-store", order, "alice", 10);
    check("an unknown store is refused", false);
  } catch (err) {
    if (grpc) {
      // connect's Code.InvalidArgument
      check("an unknown store is refused: INVALID_ARGUMENT", err.code === 3, String(err));
    } else {
      const answer = JSON.parse(err.message);
      check("an unknown store is refused: 400", answer.status === 400, answer);
      check("... ERR_LOCK_STORE_NOT_FOUND", JSON.parse(answer.error_msg).errorCode === "ERR_LOCK_STORE_NOT_FOUND", answer);
    }
  }
}

async function noQuorum(a) {
  const name = `js-${protocolName}-noquorum-${RUN}`;
  try {
    await a.lock.lock(STORE, name, "alice", 5);
    check("no quorum: the lock call fails", false);
  } catch (err) {
    if (grpc) {
      check("no quorum: INTERNAL, as daprd answers a store failure", err.code === 13, String(err));
      check("no quorum: x-redlock-reason no_quorum", err.metadata && err.metadata.get("x-redlock-reason") === "no_quorum", String(err));
    } else {
      const answer = JSON.parse(err.message);
      const body = JSON.parse(answer.error_msg);
      check("no quorum: 500 ERR_TRY_LOCK_FAILED, as daprd answers", answer.status === 500 && body.errorCode === "ERR_TRY_LOCK_FAILED", answer);
      check("no quorum: the reason REDLOCK_NO_QUORUM in Dapr's details", body.details && body.details[0].reason === "REDLOCK_NO_QUORUM", body);
    }
  }
  const unlocked = await a.lock.unlock(STORE, name, "alice");
  check("no quorum: unlock answers InternalError", unlocked.status === INTERNAL_ERROR, unlocked);
}

async function main() {
  const logger = { level: LogLevel.Error };
  const a = new DaprClient({ communicationProtocol: protocol, logger });
  const bPort = grpc ? process.env.B_GRPC_PORT : process.env.B_HTTP_PORT;
  const b = new DaprClient({ daprHost: "127.0.0.1", daprPort: bPort, communicationProtocol: protocol, logger });
  if (mode === "CASES") {
    await cases(a, b);
  } else {
    await noQuorum(a);
  }
  console.log(`js/${protocolName}: ${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}

main().catch((err) => {
  console.log(`FAIL js/${protocolName}: ${err && err.stack ? err.stack : err}`);
  process.exit(1);
});
