#!/usr/bin/env bash
# Installs the servers the tests run for real: Prometheus + promtool, Alertmanager + amtool, the
# Pushgateway, and Chromium (the exporter's page checked in a headless browser) (Debian packages). As
# root it installs them; otherwise it says what to run.
set -euo pipefail
need=()
for bin in prometheus promtool prometheus-alertmanager amtool prometheus-pushgateway chromium; do
  command -v "$bin" >/dev/null 2>&1 || need+=("$bin")
done
[ ${#need[@]} -eq 0 ] && exit 0
packages="prometheus prometheus-alertmanager prometheus-pushgateway chromium"
if [ "$(id -u)" -eq 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $packages >/dev/null
else
  echo "missing: ${need[*]}; run: sudo apt-get install -y --no-install-recommends $packages" >&2
  exit 1
fi
