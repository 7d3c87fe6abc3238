#!/usr/bin/env bash
# Run a command in a private network namespace whose only interface is loopback (127.0.0.1), so that
# nothing it starts can listen on, or reach, any other address. The tests run this way: Prometheus,
# Alertmanager and rlwatch bind 127.0.0.1 themselves, but Ray binds its GCS, raylet and workers on
# every interface whatever it is told, and here every interface is loopback.
#
# Uses `unshare --net` as root, `unshare --map-root-user --net` otherwise. Where neither is allowed
# (a container without the capability, user namespaces disabled) it says so and runs the command
# as it is; RLWATCH_REQUIRE_LOOPBACK_ONLY=1 makes that an error instead.
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: $0 command [args...]" >&2
  exit 2
fi

up_and_run='set -e
if command -v ip >/dev/null 2>&1; then ip link set lo up; else ifconfig lo 127.0.0.1 up; fi
exec "$@"'

for flags in "--net" "--map-root-user --net"; do
  # shellcheck disable=SC2086 # flags are two fixed word lists
  if unshare $flags sh -c "$up_and_run" probe true >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    exec unshare $flags sh -c "$up_and_run" loopback-only "$@"
  fi
done
if [ "${RLWATCH_REQUIRE_LOOPBACK_ONLY:-0}" = "1" ]; then
  echo "loopback-only: cannot create a network namespace here (unshare --net refused)" >&2
  exit 1
fi
echo "loopback-only: cannot create a network namespace here; running without one" >&2
exec "$@"
