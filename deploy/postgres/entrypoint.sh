#!/bin/sh
# Initialises PGDATA on first start (POSTGRES_USER / POSTGRES_DB / POSTGRES_PASSWORD or
# POSTGRES_PASSWORD_FILE, password authentication from the network), then execs the
# server in the foreground as PID 1's child (compose runs it with `init: true`).
set -eu
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
    POSTGRES_PASSWORD="$(cat "$POSTGRES_PASSWORD_FILE")"
fi
if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "postgres-entrypoint: set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE" >&2
    exit 1
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 -D "$PGDATA" >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
    if [ "$db" != "postgres" ]; then
        pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        psql -v ON_ERROR_STOP=1 --username="$user" --dbname=postgres \
            -c "CREATE DATABASE \"$db\" OWNER \"$user\"" >/dev/null
        pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
    echo "postgres-entrypoint: initialised $PGDATA (user $user, database $db)"
fi
exec "$@"
