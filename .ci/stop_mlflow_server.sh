#!/usr/bin/env bash
# Stop what .ci/start_mlflow_server.sh DIR started: the mlflow server (and its workers), then PostgreSQL.
set -uo pipefail
DIR=$(realpath -m "$1")
if [ -s "$DIR/mlflow.pid" ]; then
    pid=$(cat "$DIR/mlflow.pid")
    pkill -TERM -P "$pid" 2>/dev/null
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null
    rm -f "$DIR/mlflow.pid"
fi
PG=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
PGDIR=$(cat "$DIR/pgdir" 2>/dev/null)
if [ -n "$PG" ] && [ -n "$PGDIR" ] && [ -s "$PGDIR/data/postmaster.pid" ]; then
    if [ "$(id -u)" = 0 ]; then
        su -s /bin/sh postgres -c "$PG/pg_ctl -D '$PGDIR/data' -m fast -w stop" >/dev/null
    else
        "$PG/pg_ctl" -D "$PGDIR/data" -m fast -w stop >/dev/null
    fi
fi
if [ -n "$PGDIR" ] && [ "$PGDIR" != "$DIR/pg" ]; then
    cp "$PGDIR/postgres.log" "$DIR/postgres.log" 2>/dev/null
    rm -rf "$PGDIR"
fi
exit 0
