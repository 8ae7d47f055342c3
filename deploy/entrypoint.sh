#!/bin/sh
# Entry point of the LiveLoop image: turns secrets mounted as files into the environment
# variables LiveLoop reads, then runs `liveloop "$@"`. For every variable LIVELOOP_X_FILE
# (and PGPASSWORD_FILE, read by the PostgreSQL driver) the file's content becomes
# LIVELOOP_X (PGPASSWORD), trailing newline removed; the _FILE variable is dropped.
set -eu
for var in $(env | sed -n 's/^\(LIVELOOP_[A-Z0-9_]*_FILE\|PGPASSWORD_FILE\)=.*/\1/p'); do
    eval "path=\${$var}"
    if [ ! -r "$path" ]; then
        echo "liveloop-entrypoint: $var names $path, which cannot be read" >&2
        exit 1
    fi
    value="$(cat "$path")"
    export "${var%_FILE}=$value"
    unset "$var"
done
exec liveloop "$@"
