#!/usr/bin/env bash
# The static binary in an image that holds nothing else: `redlock-sidecar install` copies it
# into an empty directory, which becomes a chroot with only Debian's static busybox, /etc/hosts,
# and the /dev nodes and /proc every container runtime provides (guard's supervisor re-executes
# the binary through /proc/self/exe and finds CMD's whole process tree in /proc). `guard` runs there against three real
# redis-server nodes addressed by host name, and must take the lock and run its command.
# Then the same without /dev/urandom (the binary calls getrandom(2) itself), and with getrandom
# denied by seccomp (one clear line, exit 71, no panic).
#
#   scripts/e2e-static.sh            build the static binary (scripts/build-static.sh) and test it
#   STATIC_BIN=PATH scripts/e2e-static.sh   test a binary built before (CI builds it once)
#   scripts/e2e-static.sh --arch arm64      the same for the arm64 binary, cross-built and run under
#                                    qemu-user-static through binfmt_misc (about 10 minutes on 2 cores;
#                                    not part of scripts/test.sh)
# Needs root (chroot, mknod, mount); installs busybox-static and redis-server when missing, and for
# another architecture its cross toolchain and qemu-user-static (and registers qemu with binfmt_misc,
# which the chroot needs: guard re-executes itself for its supervisor).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"
# shellcheck source=scripts/ci-tools.sh
source scripts/ci-tools.sh
install_redis
[ -x /bin/busybox ] && ! LC_ALL=C readelf -l /bin/busybox | grep -q 'program interpreter' \
  || apt_install busybox-static

ARCH=""
if [ "${1:-}" = "--arch" ]; then ARCH="${2:?--arch needs amd64 or arm64}"; fi
HOST_ARCH="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
if [ -n "${ARCH}" ] && [ "${ARCH}" != "${HOST_ARCH}" ]; then
  case "${ARCH}" in
    arm64) CROSS_GCC=aarch64-linux-gnu-gcc CROSS=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross) QEMU=qemu-aarch64 ;;
    amd64) CROSS_GCC=x86_64-linux-gnu-gcc CROSS=(gcc-x86-64-linux-gnu libc6-dev-amd64-cross) QEMU=qemu-x86_64 ;;
    *) echo "unsupported architecture ${ARCH}"; exit 2 ;;
  esac
  command -v "${CROSS_GCC}" >/dev/null || apt_install "${CROSS[@]}"
  [ -x "/usr/bin/${QEMU}-static" ] || apt_install qemu-user-static binfmt-support
  # The kernel runs foreign executables (the binary, and its re-execution as the supervisor, also
  # inside the chroot) through qemu once it is registered with binfmt_misc (flag F: the
  # interpreter is opened now, so the chroot needs no copy of it).
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  [ -e "/proc/sys/fs/binfmt_misc/${QEMU}" ] || update-binfmts --enable "${QEMU}" >/dev/null
  grep -q '^flags: .*F' "/proc/sys/fs/binfmt_misc/${QEMU}" || { echo "${QEMU} is registered without flag F"; exit 1; }
fi
BIN="${STATIC_BIN:-$(bash scripts/build-static.sh ${ARCH:+--arch "${ARCH}"})}"
[ -x "${BIN}" ] || { echo "no static binary at ${BIN}"; exit 1; }
echo "testing $(file -b "${BIN}" | cut -d, -f1-2)"

WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "${pid}" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "${pid}" 2>/dev/null || true; done
  if [ -n "${ROOT:-}" ] && mountpoint -q "${ROOT}/proc" 2>/dev/null; then umount "${ROOT}/proc"; fi
  rm -rf "${WORK}"
}
trap cleanup EXIT

fail() { echo "FAIL: $*"; exit 1; }
wait_until() { # wait_until WHAT COMMAND...: retry every 0.1s for up to 20s
  local what="$1" end=$((SECONDS + 20)); shift
  until "$@" >/dev/null 2>&1; do
    [ "${SECONDS}" -lt "${end}" ] || fail "timed out waiting for ${what}"
    sleep 0.1
  done
}

# --- The image: an empty directory, the installed binary, busybox, /etc/hosts, /dev ------------
ROOT="${WORK}/root"
mkdir -p "${ROOT}/redlock"
[ -z "$(ls -A "${ROOT}/redlock")" ] || fail "install target not empty"
"${BIN}" install "${ROOT}/redlock" >/dev/null
[ -x "${ROOT}/redlock/redlock-sidecar" ] || fail "install did not write redlock/redlock-sidecar"
mkdir -p "${ROOT}/bin" "${ROOT}/etc" "${ROOT}/tmp" "${ROOT}/dev"
cp /bin/busybox "${ROOT}/bin/busybox"
ln -s busybox "${ROOT}/bin/sh"
ln -s busybox "${ROOT}/bin/cat"
make_dev() { # the nodes a container runtime always creates
  mknod -m 666 "${ROOT}/dev/null" c 1 3
  mknod -m 666 "${ROOT}/dev/zero" c 1 5
  mknod -m 666 "${ROOT}/dev/full" c 1 7
  mknod -m 666 "${ROOT}/dev/random" c 1 8
  mknod -m 666 "${ROOT}/dev/urandom" c 1 9
  mknod -m 666 "${ROOT}/dev/tty" c 5 0
}
make_dev
mkdir -p "${ROOT}/proc"
mount -t proc proc "${ROOT}/proc"
echo "chroot: $(cd "${ROOT}" && find . -mindepth 1 -path ./proc -prune -o -print | sort | tr '\n' ' ')"

# --- Three Redis masters, known in the chroot by host name only ----------------------------------
read -r -a PORTS <<<"$(python3 -c '
import socket
s = [socket.socket() for _ in range(3)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))')"
NAMES=(redis-a redis-b redis-c)
URLS=()
{ echo "127.0.0.1 localhost"; for i in 0 1 2; do echo "127.0.0.1 ${NAMES[$i]}.redis.internal ${NAMES[$i]}"; done; } \
  >"${ROOT}/etc/hosts"
for i in 0 1 2; do
  redis-server --port "${PORTS[$i]}" --bind 127.0.0.1 --save '' --appendonly no --dir "${WORK}" \
    --dbfilename "n${i}.rdb" --loglevel warning >"${WORK}/redis-${i}.log" 2>&1 &
  PIDS+=($!)
  URLS+=("redis://${NAMES[$i]}.redis.internal:${PORTS[$i]}")
done
for i in 0 1 2; do wait_until "redis ${i}" redis-cli -p "${PORTS[$i]}" ping; done
REDIS="$(IFS=,; echo "${URLS[*]}")"

# guard LOCK: runs guard in the chroot; CMD writes its fencing token into /tmp/ran-LOCK.
# --wait: fresh nodes count only after ttl + drift (the data-age vote rule).
guard() {
  local lock="$1"
  chroot "${ROOT}" /redlock/redlock-sidecar guard --lock "${lock}" --redis "${REDIS}" \
    --ttl 3s --kill-grace 500ms --wait 20s --on-busy fail --identity static-e2e \
    -- /bin/sh -c 'echo "$REDLOCK_LOCK $REDLOCK_FENCING_TOKEN" > /tmp/ran-$REDLOCK_LOCK'
}
assert_ran() { # assert_ran LOCK: CMD ran with a fencing token that a quorum of nodes stored
  local lock="$1" line token stored=0 i
  line="$(cat "${ROOT}/tmp/ran-${lock}" 2>/dev/null)" || fail "CMD did not run for ${lock}"
  token="${line#"${lock} "}"
  [[ "${token}" =~ ^[0-9]+$ ]] && [ "${token}" -gt 0 ] || fail "no fencing token: ${line}"
  for i in 0 1 2; do
    [ "$(redis-cli -p "${PORTS[$i]}" GET "redlock:{${lock}}:fence")" = "${token}" ] && stored=$((stored + 1))
  done
  [ "${stored}" -ge 2 ] || fail "token ${token} of ${lock} is on ${stored} nodes, not a quorum"
  for i in 0 1 2; do
    [ "$(redis-cli -p "${PORTS[$i]}" EXISTS "redlock:{${lock}}")" = 0 ] || fail "${lock} not released on node ${i}"
  done
  echo "PASS  ${lock}: CMD ran under the lock, fencing token ${token} on ${stored} of 3 nodes, released"
}

# 1. The chroot with the runtime's /dev nodes.
guard static-e2e || fail "guard exited $?"
assert_ran static-e2e

# 2. No /dev at all: randomness comes from the getrandom system call, not /dev/urandom.
rm -f "${ROOT}"/dev/*
guard static-e2e-nodev || fail "guard without /dev exited $?"
assert_ran static-e2e-nodev

# 3. The sidecar itself (`run`) in the same chroot: it leads, answers GET /leader with 200, and
# releases the lock on SIGTERM, exiting 0.
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
chroot "${ROOT}" /redlock/redlock-sidecar run --lock static-run --redis "${REDIS}" --kubernetes off \
  --listen "127.0.0.1:${PORT}" --identity static-run >"${WORK}/run.log" 2>&1 &
RUN_PID=$!
PIDS+=("${RUN_PID}")
leads() { [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:${PORT}/leader")" = 200 ]; }
command -v curl >/dev/null || apt_install curl
wait_until "run to lead" leads
kill -TERM "${RUN_PID}"
code=0; wait "${RUN_PID}" || code=$?
[ "${code}" = 0 ] || fail "run exited ${code} after SIGTERM: $(tail -n 5 "${WORK}/run.log")"
for i in 0 1 2; do
  [ "$(redis-cli -p "${PORTS[$i]}" EXISTS "redlock:{static-run}")" = 0 ] || fail "static-run not released on node ${i}"
done
echo "PASS  run: led, GET /leader 200, released on SIGTERM and exited 0"

# 4. getrandom(2) denied by seccomp and no /dev/urandom: no random source at all. Not under qemu,
# which itself stops at start-up without a random source ("cannot initialize crypto").
if [ -n "${QEMU:-}" ]; then
  echo "NOT RUN  no random source: under ${QEMU} the emulator, not the binary, needs one"
  echo "e2e-static (${ARCH}, under ${QEMU}): passed ($(du -h "${BIN}" | cut -f1) static binary)"
  exit 0
fi
set +e
python3 - "${ROOT}" "${REDIS}" >"${WORK}/seccomp.out" 2>&1 <<'PY'
import ctypes, os, struct, sys
root, redis = sys.argv[1], sys.argv[2]
os.chroot(root)
os.chdir("/")
libc = ctypes.CDLL(None, use_errno=True)
# BPF: on x86_64, getrandom (318) fails with EPERM; everything else is allowed. (A foreign binary
# runs under qemu, whose system calls are the host's: the same filter applies.)
AUDIT_ARCH_X86_64, NR_GETRANDOM = 0xC000003E, 318
LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
prog = [(LD_W_ABS, 0, 0, 4), (JEQ_K, 0, 3, AUDIT_ARCH_X86_64), (LD_W_ABS, 0, 0, 0),
        (JEQ_K, 0, 1, NR_GETRANDOM), (RET_K, 0, 0, 0x00050000 | 1), (RET_K, 0, 0, 0x7FFF0000)]
raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
buf = ctypes.create_string_buffer(raw)
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog(len(prog), ctypes.addressof(buf))
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
assert libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
assert libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()
os.execv("/redlock/redlock-sidecar", ["redlock-sidecar", "guard", "--lock", "static-e2e-norandom",
         "--redis", redis, "--", "/bin/sh", "-c", "echo ran > /tmp/ran-norandom"])
PY
code=$?
set -e
out="$(cat "${WORK}/seccomp.out")"
[ "${code}" = 71 ] || fail "without a random source guard exited ${code}, not 71: ${out}"
[ "$(printf '%s\n' "${out}" | wc -l)" = 1 ] || fail "not one line: ${out}"
grep -q 'no random source' <<<"${out}" || fail "unclear message: ${out}"
grep -qi 'panic' <<<"${out}" && fail "panicked: ${out}"
[ ! -e "${ROOT}/tmp/ran-norandom" ] || fail "CMD ran without a random source"
echo "PASS  no random source: exit 71, ${out}"
echo "e2e-static: passed ($(du -h "${BIN}" | cut -f1) static binary)"
