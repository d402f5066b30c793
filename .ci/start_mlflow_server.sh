#!/usr/bin/env bash
# Start a PostgreSQL cluster and an `mlflow server` on it, both owned by the caller's test run.
#   .ci/start_mlflow_server.sh DIR [PG_PORT] [MLFLOW_PORT]
# DIR receives the artifacts (DIR/artifacts), logs and pid files; the script
# prints the tracking URI (http://127.0.0.1:MLFLOW_PORT) once the server answers /health.
# Stop both with .ci/stop_mlflow_server.sh DIR. Runs as root (PostgreSQL runs as `postgres`) or as
# an ordinary user (PostgreSQL runs as that user). Installs Debian's postgresql when it is missing.
set -euo pipefail

DIR=$(realpath -m "$1")
PG_PORT=${2:-55432}
MLFLOW_PORT=${3:-55000}
PYTHON=${PYTHON:-python}

pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }
if [ -z "$(pg_bin)" ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
PG=$(pg_bin)

mkdir -p "$DIR/artifacts"
# PostgreSQL's files: under DIR for an ordinary user; as root, in a directory the `postgres` user
# can reach (test directories are often private to root), recorded in DIR/pgdir for the stop script.
if [ "$(id -u)" = 0 ]; then
    PGDIR=$(mktemp -d "${TMPDIR:-/tmp}/graft-pg.XXXXXX")
    chmod 755 "$PGDIR" && chown postgres:postgres "$PGDIR"
    as_pg() { su -s /bin/sh postgres -c "$*"; }
else
    PGDIR=$DIR/pg
    mkdir -p "$PGDIR"
    as_pg() { sh -c "$*"; }
fi
echo "$PGDIR" >"$DIR/pgdir"
as_pg "mkdir -p '$PGDIR/data' '$PGDIR/sock' && $PG/initdb -D '$PGDIR/data' -A trust -U postgres --no-sync >'$PGDIR/initdb.log'"
as_pg "$PG/pg_ctl -D '$PGDIR/data' -l '$PGDIR/postgres.log' -w -o \"-p $PG_PORT -k '$PGDIR/sock' -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off\" start" >/dev/null
as_pg "$PG/createdb -h 127.0.0.1 -p $PG_PORT -U postgres mlflow"

# The server creates/migrates the schema itself before it starts serving.
nohup "$PYTHON" -m mlflow server \
    --backend-store-uri "postgresql+psycopg2://postgres@127.0.0.1:$PG_PORT/mlflow" \
    --artifacts-destination "$DIR/artifacts" \
    --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 2 >"$DIR/mlflow.log" 2>&1 &
echo $! >"$DIR/mlflow.pid"

for _ in $(seq 180); do
    if "$PYTHON" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$MLFLOW_PORT/health', timeout=2)" 2>/dev/null; then
        echo "http://127.0.0.1:$MLFLOW_PORT"
        exit 0
    fi
    if ! kill -0 "$(cat "$DIR/mlflow.pid")" 2>/dev/null; then
        echo "start_mlflow_server: mlflow server exited; see $DIR/mlflow.log" >&2
        tail -20 "$DIR/mlflow.log" >&2
        exit 1
    fi
    sleep 1
done
echo "start_mlflow_server: no answer on port $MLFLOW_PORT after 180 s; see $DIR/mlflow.log" >&2
exit 1
