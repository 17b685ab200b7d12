#!/usr/bin/env bash
# Install (Debian packages) and start the PostgreSQL and Redis servers the scale-out tests use, on
# localhost, when they are not running yet. Idempotent. Creates the role and database
# kvmemory/kvmemory (password kvmemory) that KVMEMORY_POSTGRES_URL's default names.
set -euo pipefail
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing+=(postgresql)
if [ ${#missing[@]} -gt 0 ]; then
    as_root apt-get update -q
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -q "${missing[@]}"
fi

if ! redis-cli -p 6379 ping >/dev/null 2>&1; then
    as_root redis-server --port 6379 --bind 127.0.0.1 --daemonize yes --save '' --appendonly no
    for _ in $(seq 50); do redis-cli -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi

version=$(ls /usr/lib/postgresql | sort -n | tail -1)
if ! pg_lsclusters -h 2>/dev/null | grep -q "^$version main"; then
    as_root pg_createcluster "$version" main
fi
if ! pg_lsclusters -h | grep -q "^$version main .* online"; then
    as_root pg_ctlcluster "$version" main start
fi
psql_admin() { as_root runuser -u postgres -- psql -v ON_ERROR_STOP=1 -qtA "$@"; }
if [ "$(psql_admin -c "SELECT 1 FROM pg_roles WHERE rolname = 'kvmemory'")" != 1 ]; then
    psql_admin -c "CREATE ROLE kvmemory LOGIN PASSWORD 'kvmemory'"
fi
# CREATEDB: LangGraph's own PostgreSQL saver tests (kvmemory_lab.harness.upstream_saver_tests) make one per test
psql_admin -c "ALTER ROLE kvmemory CREATEDB"
if [ "$(psql_admin -c "SELECT 1 FROM pg_database WHERE datname = 'kvmemory'")" != 1 ]; then
    psql_admin -c "CREATE DATABASE kvmemory OWNER kvmemory"
fi
echo "services: redis on 127.0.0.1:6379, postgres $version on localhost:5432 (database kvmemory)"
