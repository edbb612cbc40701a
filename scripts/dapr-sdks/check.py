"""Dapr's Python SDK, unchanged, against redlock-sidecar over gRPC (run by scripts/dapr-sdks.sh).

The app is written as for Dapr: DaprClient() finds the sidecar from DAPR_HTTP_PORT (its health
check) and DAPR_GRPC_PORT (the lock calls). A second client reaches another sidecar on the same
Redis nodes (DaprClient(address=...)), as another pod of the app would.

  python check.py CASES    lock, contention, wrong-owner unlock, unlock, expiry, a bad store
  python check.py NOQUORUM with too few nodes left: an error that says so, unlock status 3
"""

import os
import sys
import time
import uuid
import warnings

import grpc
from dapr.clients import DaprClient
from dapr.clients.exceptions import DaprGrpcError
from dapr.clients.grpc._response import UnlockResponseStatus

warnings.simplefilter('ignore')  # the lock API's "Alpha" warning on every call
STORE = os.environ.get('STORE', 'redlock')
RUN = uuid.uuid4().hex[:8]
passed = failed = 0


def check(name, ok, detail=''):
    global passed, failed
    if ok:
        passed += 1
        print(f'ok   python/grpc: {name}')
    else:
        failed += 1
        print(f'FAIL python/grpc: {name} {detail}')


def header(response, name):
    values = response.headers.get(name) or []
    return values[0] if values else None


def cases(a, b):
    order = f'py-order-{RUN}'
    # Lock: taken, with the fencing token and validity beside Dapr's answer.
    taken = a.try_lock(STORE, order, 'alice', 10)
    check('lock: taken', taken.success)
    token = header(taken, 'x-redlock-fencing-token')
    check('lock: fencing token in the response metadata', token is not None and token.isdigit(), taken.headers)
    validity = header(taken, 'x-redlock-validity-ms')
    check('lock: validity in the response metadata', validity is not None and 0 < int(validity) <= 10000, validity)
    # Contention: another owner through either sidecar, and the same owner again (no re-entry).
    for client, where in [(a, 'this sidecar'), (b, 'another sidecar')]:
        held = client.try_lock(STORE, order, 'bob', 10)
        check(f'contention: another owner through {where} is refused', not held.success)
        check(f'contention: the reason is "held" ({where})', header(held, 'x-redlock-reason') == 'held', held.headers)
    check('contention: no re-entry for the same owner', not a.try_lock(STORE, order, 'alice', 10).success)
    # Wrong-owner unlock, through either sidecar.
    for client, where in [(a, 'this sidecar'), (b, 'another sidecar')]:
        status = client.unlock(STORE, order, 'bob').status
        check(f'wrong-owner unlock through {where}: LOCK_BELONGS_TO_OTHERS', status == UnlockResponseStatus.lock_belongs_to_others, status)
    # Unlock, then it is gone, then free for the other owner.
    check('unlock: SUCCESS', a.unlock(STORE, order, 'alice').status == UnlockResponseStatus.success)
    check('unlock again: LOCK_DOES_NOT_EXIST', a.unlock(STORE, order, 'alice').status == UnlockResponseStatus.lock_does_not_exist)
    check('unlock of a lock never taken: LOCK_DOES_NOT_EXIST', b.unlock(STORE, f'never-{RUN}', 'alice').status == UnlockResponseStatus.lock_does_not_exist)
    second = b.try_lock(STORE, order, 'bob', 10)
    check('after the unlock another owner takes it', second.success)
    later = int(header(second, 'x-redlock-fencing-token') or 0)
    check('its fencing token is larger', token is not None and later > int(token), (token, later))
    b.unlock(STORE, order, 'bob')
    # Expiry: a lock of 2 s is free again once its expiry passed, without an unlock.
    short = f'py-short-{RUN}'
    check('expiry: taken for 2 s', a.try_lock(STORE, short, 'alice', 2).success)
    check('expiry: held before it expires', not b.try_lock(STORE, short, 'bob', 2).success)
    began = time.monotonic()
    while not b.try_lock(STORE, short, 'bob', 2).success and time.monotonic() - began < 6:
        time.sleep(0.2)
    waited = time.monotonic() - began
    check('expiry: another owner takes it once it expired', 1.0 < waited < 6, f'after {waited:.1f} s')
    # A store this sidecar does not have: Dapr's INVALID_ARGUMENT.
    try:
        a.try_lock('no-such-store', order, 'alice', 10)
        check('an unknown store is refused', False)
    except grpc.RpcError as err:
        check('an unknown store is refused: INVALID_ARGUMENT', err.code() == grpc.StatusCode.INVALID_ARGUMENT, err)
        check('... naming the store', 'no-such-store' in (err.details() or ''), err.details())


def no_quorum(a):
    try:
        a.try_lock(STORE, f'py-noquorum-{RUN}', 'alice', 5)
        check('no quorum: the lock call fails', False)
    except grpc.RpcError as err:
        check('no quorum: INTERNAL, as daprd answers a store failure', err.code() == grpc.StatusCode.INTERNAL, err)
        # The SDK's own parser of Dapr's rich errors reads the reason.
        parsed = DaprGrpcError(err)
        check('no quorum: the SDK reads the reason REDLOCK_NO_QUORUM', parsed.error_code() == 'REDLOCK_NO_QUORUM', parsed.json())
        trailers = dict(err.trailing_metadata() or ())
        check('no quorum: x-redlock-reason no_quorum', trailers.get('x-redlock-reason') == 'no_quorum', trailers)
    status = a.unlock(STORE, f'py-noquorum-{RUN}', 'alice').status
    check('no quorum: unlock answers INTERNAL_ERROR', status == UnlockResponseStatus.internal_error, status)


def main():
    mode = sys.argv[1]
    a = DaprClient()
    b = DaprClient(address=f"127.0.0.1:{os.environ['B_GRPC_PORT']}")
    with a, b:
        if mode == 'CASES':
            cases(a, b)
        else:
            no_quorum(a)
    print(f'python/grpc: {passed} passed, {failed} failed')
    sys.exit(1 if failed else 0)


if __name__ == '__main__':
    main()
