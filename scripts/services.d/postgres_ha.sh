# shellcheck shell=bash
# PostgreSQL as teams run it (sourced by scripts/services.sh; optional services, never defaults):
#
#   pgbouncer   PgBouncer (Debian's package) in TRANSACTION pooling mode in front of the
#               PostgreSQL on PG_PORT, listening on PGBOUNCER_PORT (6432). `env` prints
#               MQDEDUP_TEST_PGBOUNCER_URL while it answers.
#   pgbouncer-session  the same in SESSION pooling mode (server_reset_query = DISCARD ALL),
#               on PGBOUNCER_SESSION_PORT (6433): MQDEDUP_TEST_PGBOUNCER_SESSION_URL.
#   pg-replica  a streaming replica (pg_basebackup -R) of the PostgreSQL on PG_PORT, on
#               PG_REPLICA_PORT (default PG_PORT+1), application_name 'mqdedup_replica'.
#               PG_SYNC_REPLICATION=on (default off) makes the primary wait for it
#               (synchronous_standby_names = 'mqdedup_replica', synchronous_commit = on);
#               off resets synchronous_standby_names. Applied on every `start pg-replica`.
#   pg-promote  `start pg-promote` promotes that replica (pg_ctl promote) and waits until it
#               accepts writes; `status pg-promote` says whether it is a primary yet.
#
# Failover tests run all of this against a PRIVATE primary (own PG_PORT and MQDEDUP_STATE_DIR),
# never the shared one: `services.sh kill postgres` on the private port plays the crash.

ALL_SERVICES+=(pgbouncer pgbouncer-session pg-replica pg-promote)

PGBOUNCER_PORT=${PGBOUNCER_PORT:-6432}
PGBOUNCER_SESSION_PORT=${PGBOUNCER_SESSION_PORT:-6433}
PGBOUNCER_POOL_SIZE=${PGBOUNCER_POOL_SIZE:-20}
PGB_INST="$STATE_DIR/pgbouncer-$PGBOUNCER_PORT"
PGB_LOG="$PGB_INST/pgbouncer.log"

PG_REPLICA_PORT=${PG_REPLICA_PORT:-$((PG_PORT + 1))}
PG_SYNC_REPLICATION=${PG_SYNC_REPLICATION:-off}
case $PG_SYNC_REPLICATION in
on | off) ;;
*) die "PG_SYNC_REPLICATION must be 'on' or 'off', not '$PG_SYNC_REPLICATION'" ;;
esac
PGR_NAME=mqdedup_replica
PGR_INST="$STATE_DIR/postgres-replica-$PG_REPLICA_PORT"
PGR_DATA="$PGR_INST/data"
PGR_LOG="$PGR_INST/postgres.log"
PGR_SOCK=$(socket_dir_for "$PGR_INST")

# ----------------------------------------------------------------------------- pgbouncer
# Two instances share this code: `pgbouncer` (transaction pooling) and `pgbouncer-session`
# (session pooling). Each function takes the instance's port and pool mode.

pgb_inst() { echo "$STATE_DIR/pgbouncer-$1"; } # PORT
pgb_pid() { read_pid "$(pgb_inst "${1:-$PGBOUNCER_PORT}")/pgbouncer.pid"; }
pgb_managed() {
    local port=${1:-$PGBOUNCER_PORT}
    pid_alive "$(pgb_pid "$port")" "$(pgb_inst "$port")/pgbouncer.ini"
}
pgb_name() { [[ $1 == session ]] && echo pgbouncer-session || echo pgbouncer; } # MODE

pgb_start() { # PORT MODE
    local port=$1 mode=$2 name inst ini t0 deadline reset
    name=$(pgb_name "$mode")
    inst=$(pgb_inst "$port")
    ini="$inst/pgbouncer.ini"
    t0=$(now)
    if pgb_managed "$port"; then
        log "$name: already running on $HOST:$port (pid $(pgb_pid "$port"))"
        return
    fi
    if port_open "$port"; then
        log "$name: reusing what already listens on $HOST:$port (not managed from $STATE_DIR)"
        return
    fi
    need_root "starting $name"
    [[ -x /usr/sbin/pgbouncer ]] || apt_install pgbouncer
    port_open "$PG_PORT" || die "$name: no PostgreSQL on $HOST:$PG_PORT to pool (start postgres first)"
    mkdir -p "$inst"
    ensure_traversable postgres "$inst"
    if [[ $mode == session ]]; then
        # A client keeps its server connection until it disconnects; the next client
        # must not inherit its SETs, advisory locks, LISTENs or prepared statements.
        reset="server_reset_query = DISCARD ALL"
    else
        # A server connection goes back to the pool at each transaction's end: nothing of
        # a session (SET, LISTEN, advisory locks, prepared statements) survives the
        # transaction. (PgBouncer runs server_reset_query in session mode only.)
        reset="server_reset_query ="
    fi
    # Client and server logins: the test role's password in plain text (scram towards the
    # server needs it). admin_users may run SHOW VERSION / SHOW CONFIG on the 'pgbouncer' db.
    printf '"mqdedup" "mqdedup"\n' >"$inst/userlist.txt"
    cat >"$ini" <<EOF2
; Written by scripts/services.sh on every start; edits are lost.
[databases]
* = host=$HOST port=$PG_PORT

[pgbouncer]
listen_addr = $HOST
listen_port = $port
unix_socket_dir =
pool_mode = $mode
auth_type = scram-sha-256
auth_file = $inst/userlist.txt
admin_users = mqdedup
stats_users = mqdedup
max_client_conn = 1000
default_pool_size = $PGBOUNCER_POOL_SIZE
$reset
ignore_startup_parameters = extra_float_digits
logfile = $inst/pgbouncer.log
pidfile = $inst/pgbouncer.pid
EOF2
    chown -R postgres:postgres "$inst"
    chmod 600 "$inst/userlist.txt"
    log "$name: starting on $HOST:$port ($mode pooling, server $HOST:$PG_PORT)"
    (cd "$inst" && nolock runuser -u postgres -- /usr/sbin/pgbouncer -d -q "$ini") >>"$inst/pgbouncer.log.out" 2>&1 ||
        fail_start "$name" "pgbouncer did not start" "$inst/pgbouncer.log.out" "$inst/pgbouncer.log"
    deadline=$(($(date +%s) + START_TIMEOUT))
    until port_open "$port"; do
        (($(date +%s) < deadline)) || fail_start "$name" "not listening after ${START_TIMEOUT}s" "$inst/pgbouncer.log"
        sleep 0.1
    done
    log "$name: up on $HOST:$port (pid $(pgb_pid "$port"), $(/usr/sbin/pgbouncer --version | head -n 1), $(elapsed "$t0"))"
}

pgb_stop() { # PORT MODE
    local port=$1 name pid
    name=$(pgb_name "$2")
    pid=$(pgb_pid "$port")
    if ! pgb_managed "$port"; then
        log "$name: not running from $STATE_DIR"
        return
    fi
    log "$name: stopping (pid $pid)"
    kill -INT "$pid" 2>/dev/null || true
    wait_pid_gone "$pid" "$(pgb_inst "$port")/pgbouncer.ini" 30 || kill -9 "$pid" 2>/dev/null || true
    wait_port_closed "$port" 10 || true
}

pgb_kill() { # PORT MODE
    local port=$1 name pid
    name=$(pgb_name "$2")
    pid=$(pgb_pid "$port")
    pgb_managed "$port" || {
        log "$name: not running (nothing to kill)"
        return
    }
    kill -9 "$pid" 2>/dev/null || true
    wait_pids_exited 30 "$pid" || true
    wait_port_closed "$port" 10 || true
}

pgb_status() { # PORT MODE
    local port=$1 mode=$2 name
    name=$(pgb_name "$mode")
    if pgb_managed "$port" && port_open "$port"; then
        echo "$name: up ($HOST:$port, pid $(pgb_pid "$port"), pool_mode=$mode, server $HOST:$PG_PORT)"
    elif port_open "$port"; then
        echo "$name: up ($HOST:$port, external: not managed from $STATE_DIR)"
    else
        echo "$name: down ($HOST:$port)"
    fi
}

pgb_env() { # PORT MODE VARIABLE
    local port=$1 name
    name=$(pgb_name "$2")
    if port_open "$port"; then
        echo "export $3=postgresql+psycopg://mqdedup:mqdedup@$HOST:$port/mqdedup"
    else
        echo "# $3 unset: nothing listens on $HOST:$port ('$SCRIPT_PATH start $name' to run it)"
    fi
}

pgbouncer_start() { pgb_start "$PGBOUNCER_PORT" transaction; }
pgbouncer_stop() { pgb_stop "$PGBOUNCER_PORT" transaction; }
pgbouncer_kill() { pgb_kill "$PGBOUNCER_PORT" transaction; }
pgbouncer_status() { pgb_status "$PGBOUNCER_PORT" transaction; }
pgbouncer_logfiles() { printf '%s\n' "$PGB_LOG" "$PGB_LOG.out"; }
pgbouncer_env() { pgb_env "$PGBOUNCER_PORT" transaction MQDEDUP_TEST_PGBOUNCER_URL; }
EXTRA_ENV_HOOKS+=(pgbouncer_env)

pgbouncer_session_start() { pgb_start "$PGBOUNCER_SESSION_PORT" session; }
pgbouncer_session_stop() { pgb_stop "$PGBOUNCER_SESSION_PORT" session; }
pgbouncer_session_kill() { pgb_kill "$PGBOUNCER_SESSION_PORT" session; }
pgbouncer_session_status() { pgb_status "$PGBOUNCER_SESSION_PORT" session; }
pgbouncer_session_logfiles() {
    printf '%s\n' "$(pgb_inst "$PGBOUNCER_SESSION_PORT")/pgbouncer.log" "$(pgb_inst "$PGBOUNCER_SESSION_PORT")/pgbouncer.log.out"
}
pgbouncer_session_env() {
    pgb_env "$PGBOUNCER_SESSION_PORT" session MQDEDUP_TEST_PGBOUNCER_SESSION_URL
}
EXTRA_ENV_HOOKS+=(pgbouncer_session_env)

# ----------------------------------------------------------------------------- replica

pgr_pid() { read_pid "$PGR_DATA/postmaster.pid"; }
pgr_managed() { pid_alive "$(pgr_pid)" "$PGR_DATA"; }
pgr_as_postgres() { (cd "$PGR_INST" && nolock runuser -u postgres -- env HOME="$PGR_INST" PGPASSWORD=mqdedup "$@"); }
pgr_psql() { # PORT SQL: one statement as the test superuser over TCP, unaligned output
    PGPASSWORD=mqdedup nolock "$(pg_bindir)/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$HOST" -p "$1" -U mqdedup -d mqdedup -c "$2"
}

# The primary's synchronous_standby_names, from PG_SYNC_REPLICATION (reload-able).
pgr_apply_sync_mode() {
    if [[ $PG_SYNC_REPLICATION == on ]]; then
        pgr_psql "$PG_PORT" "ALTER SYSTEM SET synchronous_standby_names = '$PGR_NAME'" >/dev/null
        pgr_psql "$PG_PORT" "ALTER SYSTEM SET synchronous_commit = 'on'" >/dev/null
    else
        pgr_psql "$PG_PORT" "ALTER SYSTEM RESET synchronous_standby_names" >/dev/null
    fi
    pgr_psql "$PG_PORT" "SELECT pg_reload_conf()" >/dev/null
}

pg_replica_start() {
    local t0 b deadline
    t0=$(now)
    b=$(pg_bindir)
    if pgr_managed; then
        log "pg-replica: already running on $HOST:$PG_REPLICA_PORT (pid $(pgr_pid))"
    else
        need_root "starting pg-replica"
        pg_install
        b=$(pg_bindir)
        port_open "$PG_PORT" || die "pg-replica: no primary on $HOST:$PG_PORT (start postgres first)"
        port_open "$PG_REPLICA_PORT" && die "pg-replica: $HOST:$PG_REPLICA_PORT is taken"
        mkdir -p "$PGR_INST" "$PGR_SOCK"
        ensure_traversable postgres "$PGR_INST"
        chown postgres:postgres "$PGR_INST" "$PGR_SOCK"
        chmod 700 "$PGR_INST"
        if [[ ! -s $PGR_DATA/PG_VERSION ]]; then
            rm -rf "$PGR_DATA"
            log "pg-replica: pg_basebackup from $HOST:$PG_PORT into $PGR_DATA"
            pgr_as_postgres "$b/pg_basebackup" -h "$HOST" -p "$PG_PORT" -U mqdedup -D "$PGR_DATA" \
                -X stream -R -c fast -d "application_name=$PGR_NAME" >>"$PGR_LOG" 2>&1 ||
                fail_start pg-replica "pg_basebackup failed" "$PGR_LOG"
        fi
        # The copy carries the primary's mqdedup.conf: this one is the replica's own.
        cat >"$PGR_DATA/mqdedup.conf" <<EOF
# Written by scripts/services.d/postgres_ha.sh on every start; edits are lost.
listen_addresses = '$HOST'
port = $PG_REPLICA_PORT
unix_socket_directories = '$PGR_SOCK'
max_connections = 200
shared_buffers = 128MB
fsync = off
full_page_writes = off
synchronous_commit = on
max_prepared_transactions = 64
hot_standby = on
log_line_prefix = '%m [%p] '
log_timezone = 'UTC'
timezone = 'UTC'
EOF
        chown postgres:postgres "$PGR_DATA/mqdedup.conf"
        if [[ -f $PGR_DATA/postmaster.pid ]] && ! pgr_managed; then rm -f "$PGR_DATA/postmaster.pid"; fi
        touch "$PGR_LOG"
        chown postgres:postgres "$PGR_LOG"
        log "pg-replica: starting on $HOST:$PG_REPLICA_PORT (standby of $HOST:$PG_PORT)"
        pgr_as_postgres "$b/pg_ctl" -D "$PGR_DATA" -l "$PGR_LOG" -w -t "$START_TIMEOUT" start >>"$PGR_LOG.pg_ctl" 2>&1 ||
            fail_start pg-replica "pg_ctl start failed" "$PGR_LOG.pg_ctl" "$PGR_LOG"
    fi
    pgr_apply_sync_mode
    # Ready = the primary sees it streaming (and, with sync on, as its synchronous standby).
    local want=streaming got
    deadline=$(($(date +%s) + START_TIMEOUT))
    while :; do
        got=$(pgr_psql "$PG_PORT" "SELECT state || ':' || sync_state FROM pg_stat_replication WHERE application_name = '$PGR_NAME'" 2>/dev/null || true)
        if [[ $got == "$want":* ]]; then
            if [[ $PG_SYNC_REPLICATION == off || $got == *:sync ]]; then break; fi
        fi
        (($(date +%s) < deadline)) || fail_start pg-replica "not streaming after ${START_TIMEOUT}s (primary says '$got')" "$PGR_LOG"
        sleep 0.2
    done
    log "pg-replica: up on $HOST:$PG_REPLICA_PORT ($got, synchronous replication $PG_SYNC_REPLICATION, $(elapsed "$t0"))"
}

pg_replica_stop() {
    local pid
    pid=$(pgr_pid)
    if ! pgr_managed; then
        log "pg-replica: already stopped"
        return
    fi
    pgr_as_postgres "$(pg_bindir)/pg_ctl" -D "$PGR_DATA" -m fast -w -t 60 stop >/dev/null 2>&1 || pg_replica_kill
    wait_pids_exited 30 "$pid" || true
}

pg_replica_kill() {
    local pid kids
    pid=$(pgr_pid)
    pgr_managed || {
        log "pg-replica: not running (nothing to kill)"
        return
    }
    kids=$(pgrep -P "$pid" || true)
    # shellcheck disable=SC2086
    kill -9 "$pid" $kids 2>/dev/null || true
    # shellcheck disable=SC2086
    wait_pids_exited 30 "$pid" $kids || true
    wait_port_closed "$PG_REPLICA_PORT" 10 || true
}

pgr_role() { # prints primary / standby / down
    local r
    r=$(pgr_psql "$PG_REPLICA_PORT" "SELECT pg_is_in_recovery()" 2>/dev/null || true)
    case $r in t) echo standby ;; f) echo primary ;; *) echo down ;; esac
}

pg_replica_status() {
    local role
    role=$(pgr_role)
    if [[ $role == down ]]; then
        echo "pg-replica: down ($HOST:$PG_REPLICA_PORT)"
    else
        echo "pg-replica: up ($HOST:$PG_REPLICA_PORT, $role, pid $(pgr_pid), data $PGR_DATA)"
    fi
}

pg_replica_logfiles() { printf '%s\n' "$PGR_LOG"; }

# ----------------------------------------------------------------------------- promotion

pg_promote_start() {
    local t0 deadline
    t0=$(now)
    case $(pgr_role) in
    primary)
        log "pg-promote: $HOST:$PG_REPLICA_PORT is a primary already"
        return
        ;;
    down) die "pg-promote: no replica answers on $HOST:$PG_REPLICA_PORT" ;;
    esac
    need_root "promoting pg-replica"
    pgr_as_postgres "$(pg_bindir)/pg_ctl" -D "$PGR_DATA" -w -t "$START_TIMEOUT" promote >>"$PGR_LOG.pg_ctl" 2>&1 ||
        fail_start pg-promote "pg_ctl promote failed" "$PGR_LOG.pg_ctl" "$PGR_LOG"
    deadline=$(($(date +%s) + START_TIMEOUT))
    until [[ $(pgr_role) == primary ]]; do
        (($(date +%s) < deadline)) || fail_start pg-promote "still in recovery after ${START_TIMEOUT}s" "$PGR_LOG"
        sleep 0.1
    done
    # The new primary has no standby: it must not wait for one.
    pgr_psql "$PG_REPLICA_PORT" "ALTER SYSTEM RESET synchronous_standby_names" >/dev/null
    pgr_psql "$PG_REPLICA_PORT" "SELECT pg_reload_conf()" >/dev/null
    log "pg-promote: $HOST:$PG_REPLICA_PORT promoted to primary ($(elapsed "$t0"))"
}

pg_promote_stop() { log "pg-promote: nothing to stop (a promotion cannot be undone)"; }
pg_promote_kill() { pg_promote_stop; }
pg_promote_status() { echo "pg-promote: $HOST:$PG_REPLICA_PORT is $(pgr_role)"; }
pg_promote_logfiles() { pg_replica_logfiles; }
