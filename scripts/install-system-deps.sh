#!/usr/bin/env bash
# Installs the Debian packages the tests and the demo run for real: ZooKeeper (which brings a JRE) and
# PostgreSQL, FUSE 3 for the fault suite's power cuts, systemd's systemd-analyze, which checks the units in
# contrib/systemd, and Prometheus (prometheus and promtool: the alert rules' checks and the test that scrapes a
# real cluster). Idempotent: does nothing when they are already there.
set -euo pipefail
need=()
# The jar, as waltz.cluster.zkserver runs it (Debian 12's package ships no zkServer.sh).
[ -f /usr/share/java/zookeeper.jar ] || need+=(zookeeper)
# ZooKeeper over TLS (waltz local up --tls, the TLS tests) runs on Netty: zookeeper depends on libnetty-java,
# but its codec jar is not on zookeeper.jar's manifest classpath, so check for it by name.
[ -f /usr/share/java/netty-codec.jar ] || need+=(libnetty-java)
command -v java >/dev/null 2>&1 || need+=(default-jre-headless)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
# The fault suite's power cuts (bench/faults/powerfs.py) run a FUSE filesystem: libfuse 3 and fusermount3.
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
# tests/integration/test_deploy_files.py: systemd-analyze verify on contrib/systemd/*.service.
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
# contrib/prometheus's alert rules (promtool check/test rules) and tests/integration/test_prometheus.py. The
# package's own service is not used: the test runs a Prometheus of its own on a free loopback port.
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
echo "installing Debian packages: ${need[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
