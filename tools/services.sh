#!/usr/bin/env bash
# The services the slow tests start need on a clean Debian machine: PostgreSQL's server binaries (initdb,
# postgres) for the shared MLflow tracking server's backend store (tests/test_registry_server.py). The tests
# make, run and delete a throwaway cluster themselves (as the postgres user when run as root), so no cluster is
# made or started here. Run as root; does nothing where the binaries are already installed.
set -euo pipefail

if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    echo "services: PostgreSQL already installed ($(ls -d /usr/lib/postgresql/*/bin | tr '\n' ' '))"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "services: PostgreSQL is missing; run this as root (it installs Debian's postgresql package)" >&2
        exit 1
    fi
fi
# Debian's package makes and starts a 'main' cluster on port 5432 unless told not to: the tests need none.
$SUDO mkdir -p /etc/postgresql-common/createcluster.d
echo "create_main_cluster = false" | $SUDO tee /etc/postgresql-common/createcluster.d/dsaindex-no-main-cluster.conf >/dev/null
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql
ls -d /usr/lib/postgresql/*/bin
id postgres
