#!/usr/bin/env bash
# A PostgreSQL server on this host for a tuning session shared by several GPU workers
# (`moe-aot measure --devices all --db "$URL"`): Debian's postgresql, installed if missing, its
# default cluster started, a role and a database created if they do not exist. Prints the
# SQLAlchemy URL on stdout (everything else goes to stderr), so
#
#   URL=$(sudo tools/pg_local.sh)              # or as root; DB name: $1 (default moe_aot)
#   moe-aot measure --devices all --db "$URL"
#
# The server listens on localhost only (Debian's default) with a password the URL carries:
# enough for workers on this host, not a team server. Running it again is harmless (nothing is
# dropped); `.ci/run` does the same for the CPU tests.
set -euo pipefail
db=${1:-moe_aot}
role=${MOE_AOT_PG_ROLE:-moe_aot}
password=${MOE_AOT_PG_PASSWORD:-moe_aot}
if [ ! -d /usr/lib/postgresql ] || [ -z "$(ls /usr/lib/postgresql 2>/dev/null)" ]; then
  echo "installing Debian's postgresql ..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq postgresql >/dev/null
fi
pg_ver=$(ls /usr/lib/postgresql | sort -V | tail -1)
[ -d "/etc/postgresql/$pg_ver/main" ] || pg_createcluster "$pg_ver" main >&2
pg_ctlcluster "$pg_ver" main start 2>/dev/null || pg_ctlcluster "$pg_ver" main status >/dev/null
pg() { runuser -u postgres -- "$@"; }
pg psql -qtAc "SELECT 1 FROM pg_roles WHERE rolname = '$role'" | grep -q 1 \
  || pg psql -qc "CREATE ROLE $role LOGIN PASSWORD '$password'" >&2
pg psql -qtAc "SELECT 1 FROM pg_database WHERE datname = '$db'" | grep -q 1 || pg createdb -O "$role" "$db" >&2
echo "PostgreSQL $pg_ver running; database $db owned by $role" >&2
echo "postgresql+psycopg://$role:$password@localhost/$db"
