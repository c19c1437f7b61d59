#!/usr/bin/env bash
# mqdedup test services, natively on loopback (no Docker needed).
#
#   scripts/services.sh start   [SERVICE...]   # default: postgres rabbitmq redis kafka
#   scripts/services.sh stop    [SERVICE...]   # default: the four above (+ mariadb if it runs)
#   scripts/services.sh restart [SERVICE...]
#   scripts/services.sh kill    SERVICE...     # SIGKILL (crash tests); no-op when down
#   scripts/services.sh status  [SERVICE...]   # one line per service: "NAME: up|down (...)"
#   scripts/services.sh env                    # `export VAR=value` lines for the tests
#   scripts/services.sh logs    SERVICE        # where the logs are + their last lines
#   scripts/services.sh dist-port [AMQP_PORT [TAKEN...]]  # the Erlang dist port a node would get
#   scripts/services.sh browser                # Debian's chromium for the console's browser tests
#
# SERVICE is one of: postgres rabbitmq redis kafka mariadb (mariadb is optional, never a default).
#
# Knobs (environment): MQDEDUP_STATE_DIR (data root, default /var/tmp/mqdedup-services),
# MQDEDUP_CACHE_DIR (downloads, default /var/cache/mqdedup), PG_PORT (5432),
# RABBITMQ_PORT (5672; node rabbit-<port>@localhost, Erlang dist port <port>+20000 if free
# and outside the ephemeral port range, else another such port; RABBITMQ_DIST_PORT forces one),
# REDIS_PORT (6379), KAFKA_PORT (9092; controller KAFKA_PORT+1 or next free), MARIADB_PORT (3306),
# KAFKA_VERSION (4.1.1), KAFKA_HEAP_OPTS ("-Xmx512m -Xms256m"), MQDEDUP_START_TIMEOUT (120 s),
# KAFKA_AUTO_CREATE_TOPICS (true; "false" starts the broker with auto.create.topics.enable=false).
# Every instance lives in "$MQDEDUP_STATE_DIR/<service>-<port>", so a test can run a private
# instance next to the shared one by changing the state dir and/or the port.
# See scripts/README-services.md.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SCRIPT_PATH="$SCRIPT_DIR/$(basename "${BASH_SOURCE[0]}")"

HOST=127.0.0.1
STATE_DIR=${MQDEDUP_STATE_DIR:-/var/tmp/mqdedup-services}
case $STATE_DIR in /*) ;; *) STATE_DIR="$PWD/$STATE_DIR" ;; esac
STATE_DIR=${STATE_DIR%/}
CACHE_DIR=${MQDEDUP_CACHE_DIR:-/var/cache/mqdedup}
case $CACHE_DIR in /*) ;; *) CACHE_DIR="$PWD/$CACHE_DIR" ;; esac
START_TIMEOUT=${MQDEDUP_START_TIMEOUT:-120}

PG_PORT=${PG_PORT:-5432}
RABBITMQ_PORT=${RABBITMQ_PORT:-5672}
REDIS_PORT=${REDIS_PORT:-6379}
KAFKA_PORT=${KAFKA_PORT:-9092}
KAFKA_CONTROLLER_PORT=${KAFKA_CONTROLLER_PORT:-} # default KAFKA_PORT+1, see kafka_pick_controller_port
MARIADB_PORT=${MARIADB_PORT:-3306}
KAFKA_VERSION=${KAFKA_VERSION:-4.1.1}
KAFKA_HEAP_OPTS=${KAFKA_HEAP_OPTS:--Xmx512m -Xms256m}
KAFKA_AUTO_CREATE_TOPICS=${KAFKA_AUTO_CREATE_TOPICS:-true}
case $KAFKA_AUTO_CREATE_TOPICS in
true | false) ;;
*) echo "services.sh: KAFKA_AUTO_CREATE_TOPICS must be 'true' or 'false', not '$KAFKA_AUTO_CREATE_TOPICS'" >&2; exit 2 ;;
esac

RABBITMQ_NODE="rabbit-${RABBITMQ_PORT}@localhost"
RABBIT_DIST_PORT=${RABBITMQ_DIST_PORT:-} # chosen by rmq_pick_dist_port when unset
RABBITMQ_HOME_DIR=/var/lib/rabbitmq # its .erlang.cookie is shared by server and rabbitmqctl
RABBITMQCTL=/usr/sbin/rabbitmqctl

KAFKA_LIBS="$CACHE_DIR/kafka-$KAFKA_VERSION/libs"

DEFAULT_SERVICES=(postgres rabbitmq redis kafka)
ALL_SERVICES=(postgres rabbitmq redis kafka mariadb)

# ----------------------------------------------------------------------------- helpers

log() { printf '[services] %s\n' "$*" >&2; }
die() {
    printf '[services] ERROR: %s\n' "$*" >&2
    exit 1
}

# Runs "$@" with fd 9 (the state-dir lock) closed, so daemons never inherit the lock.
nolock() { "$@" 9>&-; }

now() { date +%s.%N; }
elapsed() { awk -v s="$1" -v e="$(now)" 'BEGIN { printf "%.1fs", e - s }'; }

port_open() { timeout 3 bash -c "exec 3<>/dev/tcp/$HOST/$1" 2>/dev/null; }

# pid_alive PID PATTERN: the process exists, is not a zombie and its command line matches.
pid_alive() {
    local pid=$1 pattern=$2 cmdline
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/cmdline ]] || return 1
    cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ -n $cmdline ]] || return 1 # zombie
    [[ $cmdline == *$pattern* ]]
}

read_pid() { if [[ -s $1 ]]; then head -n 1 "$1" | tr -dc '0-9'; fi; }

wait_pid_gone() { # PID PATTERN SECONDS
    local pid=$1 pattern=$2 deadline
    deadline=$(($(date +%s) + $3))
    while pid_alive "$pid" "$pattern"; do
        (($(date +%s) < deadline)) || return 1
        sleep 0.2
    done
}

# Fully exited (gone, or a zombie: all its files and sockets are released). A SIGKILLed process
# loses its cmdline early in exit, before its sockets close, so pid_alive alone is not enough.
pid_exited() {
    local st
    [[ -r /proc/$1/stat ]] || return 0
    st=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 0
    [[ -z $st || $st == Z || $st == X ]]
}

wait_pids_exited() { # SECONDS PID...
    local deadline p
    deadline=$(($(date +%s) + $1))
    shift
    for p in "$@"; do
        [[ $p =~ ^[0-9]+$ ]] || continue
        until pid_exited "$p"; do
            (($(date +%s) < deadline)) || return 1
            sleep 0.1
        done
    done
}

wait_port_closed() { # PORT SECONDS
    local deadline
    deadline=$(($(date +%s) + $2))
    while port_open "$1"; do
        (($(date +%s) < deadline)) || return 1
        sleep 0.2
    done
}

show_log_tail() { # FILE...
    local f
    for f in "$@"; do
        [[ -s $f ]] || continue
        printf '[services] ---- last lines of %s ----\n' "$f" >&2
        tail -n 40 "$f" >&2 || true
    done
}

fail_start() { # SERVICE MESSAGE LOGFILE...
    local svc=$1 msg=$2
    shift 2
    printf '[services] ERROR: %s: %s\n' "$svc" "$msg" >&2
    show_log_tail "$@"
    exit 1
}

need_root() { [[ $EUID -eq 0 ]] || die "$1 needs root (this script installs packages and switches users)"; }

APT_UPDATED=0
# apt_install PKG...: installs Debian packages without starting their daemons (no systemd here).
apt_install() {
    need_root "installing $*"
    mkdir -p "$STATE_DIR"
    local logf="$STATE_DIR/apt-install.log" p out need_update=0 created_policy=0 rc=0
    local opts=(-y -q --no-install-recommends -o DPkg::Lock::Timeout=600
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    export DEBIAN_FRONTEND=noninteractive
    for p in "$@"; do
        out=$(apt-cache policy "$p" 2>/dev/null || true)
        if [[ $out != *"Candidate: "* || $out == *"Candidate: (none)"* ]]; then need_update=1; fi
    done
    # Forbid maintainer scripts from starting the services (invoke-rc.d honours policy-rc.d):
    # we start our own instances from the state dir.
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\n# temporary, from mqdedup scripts/services.sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    log "installing $* with apt-get (log: $logf)"
    {
        if ((need_update)) && ((!APT_UPDATED)); then
            nolock apt-get update -q >>"$logf" 2>&1 && APT_UPDATED=1
        fi
        if ! nolock apt-get install "${opts[@]}" "$@" >>"$logf" 2>&1; then
            if ((!APT_UPDATED)); then
                # Stale package lists (404s) or an interrupted earlier install: repair and retry.
                nolock dpkg --configure -a >>"$logf" 2>&1 || true
                nolock apt-get update -q >>"$logf" 2>&1 && APT_UPDATED=1
                nolock apt-get install "${opts[@]}" "$@" >>"$logf" 2>&1
            else
                false
            fi
        fi
    } || rc=$?
    if ((created_policy)); then rm -f /usr/sbin/policy-rc.d; fi
    if ((rc != 0)); then
        show_log_tail "$logf"
        die "apt-get install $* failed"
    fi
}

# Makes sure USER can traverse down to DIR (e.g. a 0700 pytest tmp dir as the state dir).
ensure_traversable() { # USER DIR
    local user=$1 dir=$2 d path=""
    runuser -u "$user" -- test -x "$dir" 2>/dev/null && return 0
    IFS=/ read -ra parts <<<"${dir#/}"
    for d in "${parts[@]}"; do
        path="$path/$d"
        [[ -d $path ]] || break
        if ! runuser -u "$user" -- test -x "$path" 2>/dev/null; then
            log "note: chmod o+x $path so that the '$user' user can reach $dir"
            chmod o+x "$path"
        fi
    done
}

# Unix socket paths are limited to ~107 bytes: use a short dir for deep state dirs.
socket_dir_for() { # INSTANCE_DIR
    local d="$1/run"
    if ((${#d} > 80)); then
        d="/tmp/.mqdedup-$(printf '%s' "$1" | md5sum | cut -c1-12)"
    fi
    printf '%s\n' "$d"
}

# ----------------------------------------------------------------------------- postgres

PG_INST="$STATE_DIR/postgres-$PG_PORT"
PG_DATA="$PG_INST/data"
PG_LOG="$PG_INST/postgres.log"
PG_SOCK=$(socket_dir_for "$PG_INST")

pg_bindir() {
    local d best=""
    if [[ -n ${PG_BINDIR:-} ]]; then
        printf '%s\n' "$PG_BINDIR"
        return
    fi
    while IFS= read -r d; do
        if [[ -x $d/initdb && -x $d/pg_ctl ]]; then best=$d; fi
    done < <(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V)
    printf '%s\n' "$best"
}

pg_install() {
    local b
    b=$(pg_bindir)
    if [[ -z $b || ! -x $b/initdb ]]; then
        apt_install postgresql
        b=$(pg_bindir)
        [[ -n $b && -x $b/initdb ]] || die "postgres: initdb not found after installing postgresql"
    fi
}

pg_as_postgres() { (cd "$PG_INST" && nolock runuser -u postgres -- env HOME="$PG_INST" "$@"); }

pg_pid() { read_pid "$PG_DATA/postmaster.pid"; }
pg_managed() { pid_alive "$(pg_pid)" "$PG_DATA"; }

pg_ready() {
    local b
    b=$(pg_bindir)
    if [[ -n $b && -x $b/pg_isready ]]; then
        "$b/pg_isready" -q -h "$HOST" -p "$PG_PORT" -t 3 >/dev/null 2>&1
    elif command -v pg_isready >/dev/null; then
        pg_isready -q -h "$HOST" -p "$PG_PORT" -t 3 >/dev/null 2>&1
    else
        port_open "$PG_PORT"
    fi
}

pg_write_conf() {
    cat >"$PG_DATA/mqdedup.conf" <<EOF
# Written by scripts/services.sh on every start; edits are lost.
listen_addresses = '$HOST'
port = $PG_PORT
unix_socket_directories = '$PG_SOCK'
max_connections = 200
shared_buffers = 128MB
# fsync/full_page_writes only protect against an OS crash or power loss, which tests never
# cause. synchronous_commit stays ON: 'services.sh kill postgres' (SIGKILL) must never lose a
# transaction that was reported committed, or crash tests would see phantom message loss.
fsync = off
full_page_writes = off
synchronous_commit = on
max_prepared_transactions = 64
log_line_prefix = '%m [%p] '
log_timezone = 'UTC'
timezone = 'UTC'
EOF
    chown postgres:postgres "$PG_DATA/mqdedup.conf"
}

pg_start() {
    local t0 b
    t0=$(now)
    if pg_managed; then
        if pg_ready; then
            # Re-apply our settings (reload-able ones take effect without a restart).
            pg_write_conf
            pg_as_postgres "$(pg_bindir)/pg_ctl" -D "$PG_DATA" reload >/dev/null 2>&1 || true
            log "postgres: already running on $HOST:$PG_PORT (pid $(pg_pid))"
            return
        fi
    elif port_open "$PG_PORT"; then
        pg_ready || die "postgres: something else listens on $HOST:$PG_PORT and does not answer as PostgreSQL"
        log "postgres: reusing the server already listening on $HOST:$PG_PORT (not managed from $STATE_DIR)"
        return
    else
        need_root "starting postgres"
        pg_install
        b=$(pg_bindir)
        mkdir -p "$PG_INST"
        ensure_traversable postgres "$PG_INST"
        chown postgres:postgres "$PG_INST"
        chmod 700 "$PG_INST"
        mkdir -p "$PG_SOCK"
        chown postgres:postgres "$PG_SOCK"
        if [[ ! -s $PG_DATA/PG_VERSION ]]; then
            log "postgres: initdb $PG_DATA"
            rm -rf "$PG_DATA"
            pg_as_postgres "$b/initdb" -D "$PG_DATA" -U postgres -E UTF8 --locale=C \
                --auth-local=trust --auth-host=scram-sha-256 >>"$PG_LOG" 2>&1 ||
                fail_start postgres "initdb failed" "$PG_LOG"
            printf "\ninclude_if_exists = 'mqdedup.conf'\n" >>"$PG_DATA/postgresql.conf"
        fi
        pg_write_conf
        # After a SIGKILL the old postmaster may linger as a zombie until init reaps it; PostgreSQL
        # would take its pid file for a live server. Our check ignores zombies and reused pids.
        if [[ -f $PG_DATA/postmaster.pid ]] && ! pg_managed; then
            log "postgres: removing stale $PG_DATA/postmaster.pid (pid $(pg_pid) is gone)"
            rm -f "$PG_DATA/postmaster.pid"
        fi
        if [[ -e $PG_SOCK/.s.PGSQL.$PG_PORT.lock ]] && ! pg_managed; then
            rm -f "$PG_SOCK/.s.PGSQL.$PG_PORT.lock" "$PG_SOCK/.s.PGSQL.$PG_PORT"
        fi
        touch "$PG_LOG"
        chown postgres:postgres "$PG_LOG"
        log "postgres: starting on $HOST:$PG_PORT (data $PG_DATA)"
        pg_as_postgres "$b/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t "$START_TIMEOUT" start >>"$PG_LOG.pg_ctl" 2>&1 ||
            fail_start postgres "pg_ctl start failed or timed out" "$PG_LOG.pg_ctl" "$PG_LOG"
    fi
    local deadline=$(($(date +%s) + START_TIMEOUT))
    until pg_ready; do
        (($(date +%s) < deadline)) || fail_start postgres "not ready on $HOST:$PG_PORT after ${START_TIMEOUT}s" "$PG_LOG"
        pg_managed || fail_start postgres "server exited during startup" "$PG_LOG"
        sleep 0.2
    done
    # Role and database (idempotent); also proves a real query works.
    b=$(pg_bindir)
    pg_as_postgres "$b/psql" -X -q -v ON_ERROR_STOP=1 -h "$PG_SOCK" -p "$PG_PORT" -U postgres -d postgres >>"$PG_LOG" 2>&1 <<'SQL' ||
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mqdedup') THEN
    CREATE ROLE mqdedup LOGIN SUPERUSER PASSWORD 'mqdedup';
  END IF;
END
$$;
SELECT 'CREATE DATABASE mqdedup OWNER mqdedup'
 WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'mqdedup')\gexec
SQL
        fail_start postgres "could not create role/database mqdedup" "$PG_LOG"
    log "postgres: up on $HOST:$PG_PORT (pid $(pg_pid), $(elapsed "$t0"))"
}

pg_stop() {
    local pid
    pid=$(pg_pid)
    if ! pid_alive "$pid" "$PG_DATA"; then
        if port_open "$PG_PORT"; then
            log "postgres: $HOST:$PG_PORT is served by an instance not managed from $STATE_DIR; leaving it running"
        else
            log "postgres: already stopped"
        fi
        return
    fi
    log "postgres: stopping (pid $pid)"
    if ! pg_as_postgres "$(pg_bindir)/pg_ctl" -D "$PG_DATA" -m fast -w -t 60 stop >/dev/null 2>&1; then
        log "postgres: pg_ctl stop failed; killing it"
        pg_kill
        return
    fi
    wait_pid_gone "$pid" "$PG_DATA" 30 || true
    wait_pids_exited 30 "$pid" || true
    log "postgres: stopped"
}

pg_kill() {
    local pid kids
    pid=$(pg_pid)
    if ! pid_alive "$pid" "$PG_DATA"; then
        if port_open "$PG_PORT"; then
            log "postgres: $HOST:$PG_PORT is not managed from $STATE_DIR; not killing it"
        else
            log "postgres: not running (nothing to kill)"
        fi
        return
    fi
    kids=$(pgrep -P "$pid" || true)
    log "postgres: SIGKILL postmaster $pid and its children"
    # shellcheck disable=SC2086
    kill -9 "$pid" $kids 2>/dev/null || true
    wait_pid_gone "$pid" "$PG_DATA" 30 || die "postgres: pid $pid survived SIGKILL"
    # shellcheck disable=SC2086
    wait_pids_exited 30 "$pid" $kids || log "postgres: some processes are still exiting"
    wait_port_closed "$PG_PORT" 10 || true
}

pg_status() {
    if pg_ready; then
        if pg_managed; then
            echo "postgres: up ($HOST:$PG_PORT, pid $(pg_pid), data $PG_DATA)"
        else
            echo "postgres: up ($HOST:$PG_PORT, external: not managed from $STATE_DIR)"
        fi
    elif pg_managed; then
        echo "postgres: down ($HOST:$PG_PORT, pid $(pg_pid) alive but not ready)"
    else
        echo "postgres: down ($HOST:$PG_PORT)"
    fi
}

# ----------------------------------------------------------------------------- rabbitmq

RMQ_INST="$STATE_DIR/rabbitmq-$RABBITMQ_PORT"
RMQ_LOG="$RMQ_INST/log/rabbit.log"
RMQ_OUT="$RMQ_INST/server.out"

rmq_install() {
    if [[ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server || ! -x $RABBITMQCTL ]]; then
        apt_install rabbitmq-server
    fi
    # The node and every rabbitmqctl call must share one Erlang cookie: rabbitmqctl (Debian's
    # wrapper) runs as the rabbitmq user with HOME=/var/lib/rabbitmq; the node runs as root
    # with the same HOME.  Create the cookie as the rabbitmq user if it does not exist yet.
    if [[ ! -s $RABBITMQ_HOME_DIR/.erlang.cookie ]]; then
        mkdir -p "$RABBITMQ_HOME_DIR"
        head -c 32 /dev/urandom | md5sum | tr '0-9a-f' 'A-P' | cut -c1-20 >"$RABBITMQ_HOME_DIR/.erlang.cookie"
        chown rabbitmq:rabbitmq "$RABBITMQ_HOME_DIR" "$RABBITMQ_HOME_DIR/.erlang.cookie" 2>/dev/null || true
        chmod 400 "$RABBITMQ_HOME_DIR/.erlang.cookie"
    fi
}

rmqctl() { nolock "$RABBITMQCTL" -n "$RABBITMQ_NODE" "$@"; }

rmq_launcher_pid() { read_pid "$RMQ_INST/launcher.pid"; }
rmq_beam_pid() { read_pid "$RMQ_INST/rabbitmq.pid"; }
rmq_managed() { pid_alive "$(rmq_beam_pid)" "rabbit boot" || pid_alive "$(rmq_launcher_pid)" rabbitmq-server; }

rmq_write_conf() {
    mkdir -p "$RMQ_INST/log" "$RMQ_INST/mnesia"
    cat >"$RMQ_INST/rabbitmq.conf" <<EOF
# Written by scripts/services.sh on every start; edits are lost.
listeners.tcp.1 = $HOST:$RABBITMQ_PORT
distribution.listener.interface = $HOST
distribution.listener.port_range.min = $RABBIT_DIST_PORT
distribution.listener.port_range.max = $RABBIT_DIST_PORT
loopback_users.guest = true
log.console = false
log.file = $RMQ_LOG
log.file.level = info
disk_free_limit.absolute = 50MB
EOF
    printf '[].\n' >"$RMQ_INST/enabled_plugins"
    : >"$RMQ_INST/rabbitmq-env.conf"
}

# Erlang distribution port: RABBITMQ_DIST_PORT, else <port>+20000 (RabbitMQ's convention), else
# <port>-20000, else the next free port above <port>. It need not be stable across restarts
# (rabbitmqctl finds the node through epmd), only free.
# port_bindable PORT: nothing uses PORT on $HOST, neither a listener nor an outgoing
# connection's local end (a test bind; without python3, only "nobody listens").
port_bindable() {
    if command -v python3 >/dev/null 2>&1; then
        python3 -c 'import socket, sys
socket.socket().bind((sys.argv[1], int(sys.argv[2])))' "$HOST" "$1" 2>/dev/null
    else
        ! port_open "$1"
    fi
}

# rmq_free_dist_port PREFERRED [TAKEN...]: a port for a RabbitMQ node's Erlang distribution listener,
# outside the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range): a port in
# it can be taken by any outgoing connection before the node binds it, and the node then
# fails to start (dist_port_already_used). PREFERRED (the AMQP port + 20000) when it is
# outside the range and bindable, else a bindable port between 25672 and the range, then
# above it; a bindable port inside the range only if nothing else is left.
# TAKEN: ports already promised to nodes that have not bound them yet (a cluster's).
rmq_free_dist_port() {
    local preferred=$1 lo=32768 hi=60999 c
    shift
    local taken=" $* "
    [[ -r /proc/sys/net/ipv4/ip_local_port_range ]] && read -r lo hi </proc/sys/net/ipv4/ip_local_port_range
    local low=25672 span i below=()
    span=$((lo - low))
    # Below the range, starting at an offset of PREFERRED: nodes starting at once rarely meet.
    for ((i = 0; i < span; i++)); do below+=($((low + (preferred + i) % span))); done
    for c in "$preferred" "${below[@]}" $(seq $((hi + 1)) 65535); do
        ((c >= 1024 && c <= 65535)) || continue
        ((c >= lo && c <= hi)) && continue
        [[ $taken == *" $c "* ]] && continue
        port_bindable "$c" && echo "$c" && return 0
    done
    for ((c = preferred; c <= 65535; c++)); do
        [[ $taken == *" $c "* ]] && continue
        port_bindable "$c" && echo "$c" && return 0
    done
    return 1
}

rmq_pick_dist_port() {
    [[ -n $RABBIT_DIST_PORT ]] && return 0
    RABBIT_DIST_PORT=$(rmq_free_dist_port $((RABBITMQ_PORT + 20000))) ||
        die "rabbitmq: no free Erlang distribution port found"
}

rmq_launch() { # NODE INSTANCE_DIR AMQP_PORT DIST_PORT LOGFILE OUTFILE [EXTRA_ERL_ARGS]
    # Starts one RabbitMQ node in the background (its launcher pid in INSTANCE_DIR), every
    # file of it under INSTANCE_DIR; shared by the single node and the cluster's nodes.
    local node=$1 inst=$2
    (
        cd "$inst"
        export HOME=$RABBITMQ_HOME_DIR # the cookie shared by every node and rabbitmqctl
        export RABBITMQ_NODENAME=$node
        export RABBITMQ_NODE_IP_ADDRESS=$HOST
        export RABBITMQ_NODE_PORT=$3
        export RABBITMQ_DIST_PORT=$4
        export RABBITMQ_CONFIG_FILE="$inst/rabbitmq.conf"
        export RABBITMQ_ADVANCED_CONFIG_FILE="$inst/advanced.config"
        export RABBITMQ_CONF_ENV_FILE="$inst/rabbitmq-env.conf"
        export RABBITMQ_ENABLED_PLUGINS_FILE="$inst/enabled_plugins"
        export RABBITMQ_MNESIA_BASE="$inst/mnesia"
        export RABBITMQ_MNESIA_DIR="$inst/mnesia/$node"
        export RABBITMQ_FEATURE_FLAGS_FILE="$inst/mnesia/$node-feature_flags"
        export RABBITMQ_PLUGINS_EXPAND_DIR="$inst/mnesia/$node-plugins-expand"
        export RABBITMQ_LOG_BASE="$inst/log"
        export RABBITMQ_LOGS=$5
        export RABBITMQ_PID_FILE="$inst/rabbitmq.pid"
        # Erlang's system time follows the OS clock at once (the default slews it): a
        # clock step (VM suspend, NTP) otherwise leaves stream timestamps minutes behind
        # the clients' clocks, and replays by time miss what was just published.
        export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="${7:+$7 }+C multi_time_warp"
        export ERL_EPMD_ADDRESS=$HOST
        unset RABBITMQ_ALLOW_INPUT NOTIFY_SOCKET
        setsid /usr/lib/rabbitmq/bin/rabbitmq-server >>"$6" 2>&1 </dev/null 9>&- &
        echo $! >"$inst/launcher.pid"
    )
}

rmq_start() {
    local t0
    t0=$(now)
    if rmq_managed; then
        log "rabbitmq: already running as $RABBITMQ_NODE (pid $(rmq_beam_pid))"
    elif port_open "$RABBITMQ_PORT"; then
        log "rabbitmq: reusing the broker already listening on $HOST:$RABBITMQ_PORT (not managed from $STATE_DIR)"
        return
    else
        need_root "starting rabbitmq"
        rmq_install
        mkdir -p "$RMQ_INST"
        rmq_pick_dist_port
        rmq_write_conf
        rm -f "$RMQ_INST/rabbitmq.pid"
        log "rabbitmq: starting node $RABBITMQ_NODE on $HOST:$RABBITMQ_PORT (dist port $RABBIT_DIST_PORT, data $RMQ_INST/mnesia)"
        rmq_launch "$RABBITMQ_NODE" "$RMQ_INST" "$RABBITMQ_PORT" "$RABBIT_DIST_PORT" "$RMQ_LOG" "$RMQ_OUT"
    fi
    local deadline=$(($(date +%s) + START_TIMEOUT))
    until port_open "$RABBITMQ_PORT"; do
        (($(date +%s) < deadline)) || fail_start rabbitmq "AMQP port $HOST:$RABBITMQ_PORT not open after ${START_TIMEOUT}s" "$RMQ_OUT" "$RMQ_LOG"
        rmq_managed || fail_start rabbitmq "node exited during startup" "$RMQ_OUT" "$RMQ_LOG"
        sleep 0.3
    done
    rmqctl await_startup --timeout "$START_TIMEOUT" >/dev/null 2>&1 ||
        fail_start rabbitmq "'rabbitmqctl -n $RABBITMQ_NODE await_startup' failed" "$RMQ_OUT" "$RMQ_LOG"
    log "rabbitmq: up on $HOST:$RABBITMQ_PORT as $RABBITMQ_NODE (pid $(rmq_beam_pid), $(elapsed "$t0"))"
}

rmq_stop() {
    local lpid bpid
    if ! rmq_managed; then
        if port_open "$RABBITMQ_PORT"; then
            log "rabbitmq: $HOST:$RABBITMQ_PORT is served by a broker not managed from $STATE_DIR; leaving it running"
        else
            log "rabbitmq: already stopped"
        fi
        return
    fi
    lpid=$(rmq_launcher_pid)
    bpid=$(rmq_beam_pid)
    log "rabbitmq: stopping $RABBITMQ_NODE (pid ${bpid:-?})"
    if ! timeout 90 "$RABBITMQCTL" -n "$RABBITMQ_NODE" shutdown 9>&- >/dev/null 2>&1; then
        log "rabbitmq: 'rabbitmqctl shutdown' failed; sending SIGTERM"
        if [[ -n $bpid ]]; then kill -TERM "$bpid" 2>/dev/null || true; fi
    fi
    if ! wait_pid_gone "$bpid" "rabbit boot" 60 || ! wait_pid_gone "$lpid" rabbitmq-server 10; then
        log "rabbitmq: did not stop in time; killing it"
        rmq_kill
        return
    fi
    wait_pids_exited 30 "$bpid" "$lpid" || true
    wait_port_closed "$RABBITMQ_PORT" 10 || true
    log "rabbitmq: stopped"
}

rmq_kill() {
    local lpid bpid
    lpid=$(rmq_launcher_pid)
    bpid=$(rmq_beam_pid)
    if ! rmq_managed; then
        if port_open "$RABBITMQ_PORT"; then
            log "rabbitmq: $HOST:$RABBITMQ_PORT is not managed from $STATE_DIR; not killing it"
        else
            log "rabbitmq: not running (nothing to kill)"
        fi
        return
    fi
    log "rabbitmq: SIGKILL node $RABBITMQ_NODE (pid ${bpid:-?}, launcher ${lpid:-?})"
    # The launcher was started with setsid: its pid is the process group of the whole node
    # (epmd daemonizes into its own session and survives, as it should).
    if pid_alive "$lpid" rabbitmq-server; then kill -9 -- "-$lpid" 2>/dev/null || true; fi
    if pid_alive "$bpid" "rabbit boot"; then kill -9 "$bpid" 2>/dev/null || true; fi
    wait_pid_gone "$bpid" "rabbit boot" 30 || die "rabbitmq: pid $bpid survived SIGKILL"
    wait_pids_exited 30 "$bpid" "$lpid" || log "rabbitmq: node is still exiting"
    wait_port_closed "$RABBITMQ_PORT" 10 || true
}

rmq_status() {
    if port_open "$RABBITMQ_PORT"; then
        if rmq_managed; then
            echo "rabbitmq: up ($HOST:$RABBITMQ_PORT, node $RABBITMQ_NODE, pid $(rmq_beam_pid))"
        else
            echo "rabbitmq: up ($HOST:$RABBITMQ_PORT, external: not managed from $STATE_DIR)"
        fi
    elif rmq_managed; then
        echo "rabbitmq: down ($HOST:$RABBITMQ_PORT, node $RABBITMQ_NODE running but AMQP port closed)"
    else
        echo "rabbitmq: down ($HOST:$RABBITMQ_PORT)"
    fi
}

# ----------------------------------------------------------------------------- redis

REDIS_INST="$STATE_DIR/redis-$REDIS_PORT"
REDIS_LOG="$REDIS_INST/redis.log"

redis_install() {
    if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
        apt_install redis-server redis-tools
    fi
}

redis_pid() { read_pid "$REDIS_INST/redis.pid"; }
redis_managed() { pid_alive "$(redis_pid)" redis-server; }
redis_ready() {
    if command -v redis-cli >/dev/null; then
        [[ $(timeout 3 redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>/dev/null) == PONG ]]
    else
        port_open "$REDIS_PORT"
    fi
}

redis_start() {
    local t0
    t0=$(now)
    if redis_managed; then
        log "redis: already running on $HOST:$REDIS_PORT (pid $(redis_pid))"
    elif port_open "$REDIS_PORT"; then
        log "redis: reusing the server already listening on $HOST:$REDIS_PORT (not managed from $STATE_DIR)"
        return
    else
        need_root "starting redis"
        redis_install
        mkdir -p "$REDIS_INST"
        rm -f "$REDIS_INST/redis.pid"
        log "redis: starting on $HOST:$REDIS_PORT (no persistence)"
        (cd "$REDIS_INST" && nolock redis-server --bind "$HOST" --port "$REDIS_PORT" \
            --daemonize yes --pidfile "$REDIS_INST/redis.pid" --logfile "$REDIS_LOG" \
            --dir "$REDIS_INST" --save "" --appendonly no --protected-mode no \
            --databases 16 </dev/null >>"$REDIS_INST/redis.out" 2>&1) ||
            fail_start redis "redis-server failed to start" "$REDIS_INST/redis.out" "$REDIS_LOG"
    fi
    local deadline=$(($(date +%s) + START_TIMEOUT))
    until redis_ready; do
        (($(date +%s) < deadline)) || fail_start redis "no PONG from $HOST:$REDIS_PORT after ${START_TIMEOUT}s" "$REDIS_LOG"
        sleep 0.1
    done
    log "redis: up on $HOST:$REDIS_PORT (pid $(redis_pid), $(elapsed "$t0"))"
}

redis_stop() {
    local pid
    pid=$(redis_pid)
    if ! pid_alive "$pid" redis-server; then
        if port_open "$REDIS_PORT"; then
            log "redis: $HOST:$REDIS_PORT is served by a server not managed from $STATE_DIR; leaving it running"
        else
            log "redis: already stopped"
        fi
        return
    fi
    log "redis: stopping (pid $pid)"
    timeout 10 redis-cli -h "$HOST" -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || kill -TERM "$pid" 2>/dev/null || true
    if ! wait_pid_gone "$pid" redis-server 20; then
        redis_kill
        return
    fi
    wait_pids_exited 30 "$pid" || true
    log "redis: stopped"
}

redis_kill() {
    local pid
    pid=$(redis_pid)
    if ! pid_alive "$pid" redis-server; then
        if port_open "$REDIS_PORT"; then
            log "redis: $HOST:$REDIS_PORT is not managed from $STATE_DIR; not killing it"
        else
            log "redis: not running (nothing to kill)"
        fi
        return
    fi
    log "redis: SIGKILL pid $pid"
    kill -9 "$pid" 2>/dev/null || true
    wait_pid_gone "$pid" redis-server 20 || die "redis: pid $pid survived SIGKILL"
    wait_pids_exited 30 "$pid" || log "redis: still exiting"
    wait_port_closed "$REDIS_PORT" 10 || true
}

redis_status() {
    if redis_ready; then
        if redis_managed; then
            echo "redis: up ($HOST:$REDIS_PORT, pid $(redis_pid))"
        else
            echo "redis: up ($HOST:$REDIS_PORT, external: not managed from $STATE_DIR)"
        fi
    else
        echo "redis: down ($HOST:$REDIS_PORT)"
    fi
}

# ----------------------------------------------------------------------------- kafka

KAFKA_INST="$STATE_DIR/kafka-$KAFKA_PORT"
KAFKA_LOG="$KAFKA_INST/kafka.log"
KAFKA_OUT="$KAFKA_INST/kafka.out"
KAFKA_PAT="kafka.Kafka $KAFKA_INST/server.properties"

java_bin() {
    if [[ -n ${JAVA_HOME:-} && -x $JAVA_HOME/bin/java ]]; then
        printf '%s\n' "$JAVA_HOME/bin/java"
    else
        command -v java
    fi
}

kafka_install() {
    if ! java_bin >/dev/null 2>&1; then apt_install openjdk-17-jre-headless; fi
    [[ -s $KAFKA_LIBS/kafka_2.13-$KAFKA_VERSION.jar ]] && return 0
    command -v mvn >/dev/null || apt_install maven
    mkdir -p "$CACHE_DIR"
    local lockf="$CACHE_DIR/.kafka-$KAFKA_VERSION.lock" tmp t0 fetch_log
    fetch_log="$CACHE_DIR/kafka-$KAFKA_VERSION-fetch.log"
    (
        exec 8>"$lockf"
        flock -w 900 8 || die "kafka: timed out waiting for another jar download"
        [[ -s $KAFKA_LIBS/kafka_2.13-$KAFKA_VERSION.jar ]] && exit 0
        t0=$(now)
        log "kafka: fetching kafka_2.13:$KAFKA_VERSION jars with maven into $KAFKA_LIBS (log: $fetch_log)"
        tmp="$CACHE_DIR/kafka-$KAFKA_VERSION/libs.tmp.$$"
        rm -rf "$tmp"
        mkdir -p "$tmp"
        if ! (cd "$CACHE_DIR" && nolock mvn -B -q -f "$SCRIPT_DIR/kafka/pom.xml" \
            -Dkafka.version="$KAFKA_VERSION" dependency:copy-dependencies \
            -DoutputDirectory="$tmp" </dev/null >"$fetch_log" 2>&1); then
            rm -rf "$tmp"
            show_log_tail "$fetch_log"
            die "kafka: maven could not fetch the broker jars"
        fi
        [[ -s $tmp/kafka_2.13-$KAFKA_VERSION.jar ]] || die "kafka: maven ran but kafka_2.13-$KAFKA_VERSION.jar is missing"
        rm -rf "$KAFKA_LIBS"
        mv "$tmp" "$KAFKA_LIBS"
        log "kafka: jars fetched in $(elapsed "$t0")"
    )
}

kafka_pid() { read_pid "$KAFKA_INST/kafka.pid"; }
kafka_managed() { pid_alive "$(kafka_pid)" "$KAFKA_PAT"; }

kafka_tool() { # CLASS ARGS... (short-lived JVM on the broker classpath)
    local cls=$1
    shift
    nolock "$(java_bin)" -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
        -Dlog4j2.configurationFile="$KAFKA_INST/log4j2-tools.properties" \
        -cp "$KAFKA_LIBS/*" "$cls" "$@"
}

kafka_probe() { # a real metadata request
    timeout 60 "$(java_bin)" -Xmx128m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
        -Dlog4j2.configurationFile="$KAFKA_INST/log4j2-tools.properties" \
        -cp "$KAFKA_LIBS/*" org.apache.kafka.tools.TopicCommand \
        --bootstrap-server "$HOST:$KAFKA_PORT" --list 9>&- >/dev/null 2>>"$KAFKA_OUT"
}

kafka_write_conf() {
    mkdir -p "$KAFKA_INST/data"
    cat >"$KAFKA_INST/server.properties" <<EOF
# Written by scripts/services.sh on every start; edits are lost.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$HOST:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$KAFKA_INST/data
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
auto.create.topics.enable=$KAFKA_AUTO_CREATE_TOPICS
delete.topic.enable=true
offsets.topic.replication.factor=1
offsets.topic.min.isr=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# A killed consumer keeps its partitions until its session times out; tests that kill
# workers use 3 s sessions (tests/services.py kill_session_timeout_ms) instead of Kafka's
# 6 s minimum, so the next worker gets them sooner.
group.min.session.timeout.ms=1000
# A SIGKILLed broker must wait for its old registration to expire before it can register
# again (DUPLICATE_BROKER_REGISTRATION): 6 s instead of 9 s makes crash tests quicker.
broker.session.timeout.ms=6000
broker.heartbeat.interval.ms=1000
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.hours=168
EOF
    kafka_write_log4j "$KAFKA_INST" "$KAFKA_LOG"
}

# The broker's log4j2 config (to LOGFILE) and the admin tools' (to stderr) in DIR.
kafka_write_log4j() { # DIR LOGFILE
    cat >"$1/log4j2.properties" <<EOF
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = $2
appender.file.append = true
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.request.name = kafka.request.logger
logger.request.level = WARN
EOF
    cat >"$1/log4j2-tools.properties" <<EOF
status = error
appender.err.type = Console
appender.err.name = STDERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.err.ref = STDERR
EOF
}

# Controller port: KAFKA_CONTROLLER_PORT, else the one this instance used before, else
# KAFKA_PORT+1 when free, else the next free port. Remembered in <instance>/controller.port.
kafka_pick_controller_port() {
    local c
    if [[ -z $KAFKA_CONTROLLER_PORT && -s $KAFKA_INST/controller.port ]]; then
        KAFKA_CONTROLLER_PORT=$(tr -dc '0-9' <"$KAFKA_INST/controller.port")
    fi
    if [[ -z $KAFKA_CONTROLLER_PORT ]]; then
        for ((c = KAFKA_PORT + 1; c != KAFKA_PORT; c = c >= 65535 ? 1024 : c + 1)); do
            if ! port_open "$c"; then
                KAFKA_CONTROLLER_PORT=$c
                break
            fi
        done
        [[ -n $KAFKA_CONTROLLER_PORT ]] || die "kafka: no free controller port"
    fi
    printf '%s\n' "$KAFKA_CONTROLLER_PORT" >"$KAFKA_INST/controller.port"
}

kafka_start() {
    local t0 java
    t0=$(now)
    if kafka_managed; then
        log "kafka: already running on $HOST:$KAFKA_PORT (pid $(kafka_pid))"
    elif port_open "$KAFKA_PORT"; then
        log "kafka: reusing the broker already listening on $HOST:$KAFKA_PORT (not managed from $STATE_DIR)"
        return
    else
        kafka_install
        java=$(java_bin)
        mkdir -p "$KAFKA_INST"
        kafka_pick_controller_port
        kafka_write_conf
        if [[ ! -s $KAFKA_INST/data/meta.properties ]]; then
            [[ -s $KAFKA_INST/cluster.id ]] ||
                head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n' |
                sed 's/^-/A/' >"$KAFKA_INST/cluster.id" # a leading '-' reads as an option
            log "kafka: formatting $KAFKA_INST/data (cluster id $(cat "$KAFKA_INST/cluster.id"))"
            kafka_tool kafka.tools.StorageTool format -t "$(cat "$KAFKA_INST/cluster.id")" \
                -c "$KAFKA_INST/server.properties" --ignore-formatted >>"$KAFKA_OUT" 2>&1 ||
                fail_start kafka "storage format failed" "$KAFKA_OUT"
        fi
        log "kafka: starting KRaft broker on $HOST:$KAFKA_PORT (controller $HOST:$KAFKA_CONTROLLER_PORT, data $KAFKA_INST/data)"
        printf '\n==== %s starting kafka.Kafka ====\n' "$(date -u +%FT%TZ)" >>"$KAFKA_OUT"
        (
            cd "$KAFKA_INST"
            # shellcheck disable=SC2086  # KAFKA_HEAP_OPTS is a list of JVM flags
            setsid "$java" $KAFKA_HEAP_OPTS -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
                -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExitOnOutOfMemoryError \
                -Djava.awt.headless=true -Dkafka.logs.dir="$KAFKA_INST" \
                -Dlog4j2.configurationFile="$KAFKA_INST/log4j2.properties" \
                -cp "$KAFKA_LIBS/*" kafka.Kafka "$KAFKA_INST/server.properties" \
                >>"$KAFKA_OUT" 2>&1 </dev/null 9>&- &
            echo $! >"$KAFKA_INST/kafka.pid"
        )
    fi
    local deadline=$(($(date +%s) + START_TIMEOUT))
    until port_open "$KAFKA_PORT"; do
        (($(date +%s) < deadline)) || fail_start kafka "port $HOST:$KAFKA_PORT not open after ${START_TIMEOUT}s" "$KAFKA_OUT" "$KAFKA_LOG"
        kafka_managed || fail_start kafka "broker exited during startup" "$KAFKA_OUT" "$KAFKA_LOG"
        sleep 0.3
    done
    until kafka_probe; do
        (($(date +%s) < deadline)) || fail_start kafka "no metadata answer from $HOST:$KAFKA_PORT after ${START_TIMEOUT}s" "$KAFKA_OUT" "$KAFKA_LOG"
        kafka_managed || fail_start kafka "broker exited during startup" "$KAFKA_OUT" "$KAFKA_LOG"
        sleep 1
    done
    log "kafka: up on $HOST:$KAFKA_PORT (pid $(kafka_pid), $(elapsed "$t0"))"
}

kafka_stop() {
    local pid
    pid=$(kafka_pid)
    if ! pid_alive "$pid" "$KAFKA_PAT"; then
        if port_open "$KAFKA_PORT"; then
            log "kafka: $HOST:$KAFKA_PORT is served by a broker not managed from $STATE_DIR; leaving it running"
        else
            log "kafka: already stopped"
        fi
        return
    fi
    log "kafka: stopping (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_pid_gone "$pid" "$KAFKA_PAT" 90; then
        log "kafka: did not stop within 90s; killing it"
        kafka_kill
        return
    fi
    wait_pids_exited 30 "$pid" || true
    wait_port_closed "$KAFKA_PORT" 10 || true
    log "kafka: stopped"
}

kafka_kill() {
    local pid
    pid=$(kafka_pid)
    if ! pid_alive "$pid" "$KAFKA_PAT"; then
        if port_open "$KAFKA_PORT"; then
            log "kafka: $HOST:$KAFKA_PORT is not managed from $STATE_DIR; not killing it"
        else
            log "kafka: not running (nothing to kill)"
        fi
        return
    fi
    log "kafka: SIGKILL pid $pid"
    kill -9 "$pid" 2>/dev/null || true
    wait_pid_gone "$pid" "$KAFKA_PAT" 30 || die "kafka: pid $pid survived SIGKILL"
    wait_pids_exited 30 "$pid" || log "kafka: still exiting"
    wait_port_closed "$KAFKA_PORT" 10 || true
}

kafka_status() {
    if port_open "$KAFKA_PORT"; then
        if kafka_managed; then
            echo "kafka: up ($HOST:$KAFKA_PORT, pid $(kafka_pid), data $KAFKA_INST/data)"
        else
            echo "kafka: up ($HOST:$KAFKA_PORT, external: not managed from $STATE_DIR)"
        fi
    elif kafka_managed; then
        echo "kafka: down ($HOST:$KAFKA_PORT, pid $(kafka_pid) alive but port closed)"
    else
        echo "kafka: down ($HOST:$KAFKA_PORT)"
    fi
}

# ----------------------------------------------------------------------------- mariadb

MDB_INST="$STATE_DIR/mariadb-$MARIADB_PORT"
MDB_DATA="$MDB_INST/data"
MDB_LOG="$MDB_INST/mariadb.log"
MDB_SOCK="$(socket_dir_for "$MDB_INST")/mysqld.sock"

mdb_server_bin() {
    local b
    for b in /usr/sbin/mariadbd /usr/sbin/mysqld; do
        [[ -x $b ]] && { printf '%s\n' "$b"; return 0; }
    done
    return 1
}
mdb_client() { if command -v mariadb >/dev/null; then echo mariadb; else echo mysql; fi; }
mdb_admin() { if command -v mariadb-admin >/dev/null; then echo mariadb-admin; else echo mysqladmin; fi; }
mdb_install_db() { if command -v mariadb-install-db >/dev/null; then echo mariadb-install-db; else echo mysql_install_db; fi; }

mdb_install() {
    if ! mdb_server_bin >/dev/null || ! command -v "$(mdb_client)" >/dev/null; then
        apt_install mariadb-server mariadb-client
    fi
}

mdb_pid() { read_pid "$MDB_INST/mariadb.pid"; }
mdb_managed() { pid_alive "$(mdb_pid)" --datadir="$MDB_DATA"; }
mdb_ready() { port_open "$MARIADB_PORT"; }

mdb_start() {
    local t0 srv
    t0=$(now)
    if mdb_managed; then
        log "mariadb: already running on $HOST:$MARIADB_PORT (pid $(mdb_pid))"
    elif port_open "$MARIADB_PORT"; then
        log "mariadb: reusing the server already listening on $HOST:$MARIADB_PORT (not managed from $STATE_DIR)"
        return
    else
        need_root "starting mariadb"
        mdb_install
        srv=$(mdb_server_bin) || die "mariadb: no mariadbd/mysqld binary after install"
        mkdir -p "$MDB_INST" "$(dirname "$MDB_SOCK")"
        if [[ ! -d $MDB_DATA/mysql ]]; then
            log "mariadb: initializing $MDB_DATA"
            rm -rf "$MDB_DATA"
            mkdir -p "$MDB_DATA"
            nolock "$(mdb_install_db)" --no-defaults --user=root --datadir="$MDB_DATA" \
                --auth-root-authentication-method=socket --skip-test-db >>"$MDB_LOG" 2>&1 ||
                fail_start mariadb "mariadb-install-db failed" "$MDB_LOG"
        fi
        rm -f "$MDB_INST/mariadb.pid"
        log "mariadb: starting on $HOST:$MARIADB_PORT (data $MDB_DATA)"
        (
            cd "$MDB_INST"
            setsid "$srv" --no-defaults --user=root --datadir="$MDB_DATA" \
                --port="$MARIADB_PORT" --bind-address="$HOST" --socket="$MDB_SOCK" \
                --pid-file="$MDB_INST/mariadb.pid" --log-error="$MDB_LOG" \
                --skip-name-resolve --max-connections=200 --innodb-buffer-pool-size=128M \
                --innodb-flush-log-at-trx-commit=2 --character-set-server=utf8mb4 \
                --collation-server=utf8mb4_unicode_ci >>"$MDB_INST/mariadb.out" 2>&1 </dev/null 9>&- &
            echo $! >"$MDB_INST/launcher.pid"
        )
    fi
    local deadline=$(($(date +%s) + START_TIMEOUT))
    until mdb_ready && nolock "$(mdb_admin)" --no-defaults --socket="$MDB_SOCK" -uroot ping >/dev/null 2>&1; do
        (($(date +%s) < deadline)) || fail_start mariadb "not ready on $HOST:$MARIADB_PORT after ${START_TIMEOUT}s" "$MDB_INST/mariadb.out" "$MDB_LOG"
        pid_alive "$(read_pid "$MDB_INST/launcher.pid")" --datadir="$MDB_DATA" || mdb_managed ||
            fail_start mariadb "server exited during startup" "$MDB_INST/mariadb.out" "$MDB_LOG"
        sleep 0.3
    done
    nolock "$(mdb_client)" --no-defaults --socket="$MDB_SOCK" -uroot >>"$MDB_LOG" 2>&1 <<'SQL' ||
CREATE DATABASE IF NOT EXISTS mqdedup CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci;
CREATE USER IF NOT EXISTS 'mqdedup'@'%' IDENTIFIED BY 'mqdedup';
CREATE USER IF NOT EXISTS 'mqdedup'@'localhost' IDENTIFIED BY 'mqdedup';
GRANT ALL PRIVILEGES ON *.* TO 'mqdedup'@'%' WITH GRANT OPTION;
GRANT ALL PRIVILEGES ON *.* TO 'mqdedup'@'localhost' WITH GRANT OPTION;
FLUSH PRIVILEGES;
SQL
        fail_start mariadb "could not create user/database mqdedup" "$MDB_LOG"
    log "mariadb: up on $HOST:$MARIADB_PORT (pid $(mdb_pid), $(elapsed "$t0"))"
}

mdb_stop() {
    local pid
    pid=$(mdb_pid)
    if ! pid_alive "$pid" --datadir="$MDB_DATA"; then
        if port_open "$MARIADB_PORT"; then
            log "mariadb: $HOST:$MARIADB_PORT is served by a server not managed from $STATE_DIR; leaving it running"
        else
            log "mariadb: already stopped"
        fi
        return
    fi
    log "mariadb: stopping (pid $pid)"
    timeout 60 "$(mdb_admin)" --no-defaults --socket="$MDB_SOCK" -uroot shutdown 9>&- >/dev/null 2>&1 ||
        kill -TERM "$pid" 2>/dev/null || true
    if ! wait_pid_gone "$pid" --datadir="$MDB_DATA" 60; then
        mdb_kill
        return
    fi
    wait_pids_exited 30 "$pid" || true
    log "mariadb: stopped"
}

mdb_kill() {
    local pid
    pid=$(mdb_pid)
    if ! pid_alive "$pid" --datadir="$MDB_DATA"; then
        if port_open "$MARIADB_PORT"; then
            log "mariadb: $HOST:$MARIADB_PORT is not managed from $STATE_DIR; not killing it"
        else
            log "mariadb: not running (nothing to kill)"
        fi
        return
    fi
    log "mariadb: SIGKILL pid $pid"
    kill -9 "$pid" 2>/dev/null || true
    wait_pid_gone "$pid" --datadir="$MDB_DATA" 30 || die "mariadb: pid $pid survived SIGKILL"
    wait_pids_exited 30 "$pid" || log "mariadb: still exiting"
    wait_port_closed "$MARIADB_PORT" 10 || true
}

mdb_status() {
    if mdb_ready; then
        if mdb_managed; then
            echo "mariadb: up ($HOST:$MARIADB_PORT, pid $(mdb_pid))"
        else
            echo "mariadb: up ($HOST:$MARIADB_PORT, external: not managed from $STATE_DIR)"
        fi
    else
        echo "mariadb: down ($HOST:$MARIADB_PORT)"
    fi
}

# ----------------------------------------------------------------------------- extensions
# Each scripts/services.d/NAME.sh adds optional services (never defaults): it appends to
# ALL_SERVICES, defines <service>_start/_stop/_kill/_status (and optionally _logfiles, one
# path per line), and may append a function to EXTRA_ENV_HOOKS that prints `export` lines.
EXTRA_ENV_HOOKS=()
if [[ -d $SCRIPT_DIR/services.d ]]; then
    for _ext in "$SCRIPT_DIR"/services.d/*.sh; do
        [[ -e $_ext ]] || continue
        # shellcheck source=/dev/null
        source "$_ext"
    done
    unset _ext
fi

# ----------------------------------------------------------------------------- commands

svc_fn() { # SERVICE ACTION -> function name
    case $1 in
    postgres) echo "pg_$2" ;;
    rabbitmq) echo "rmq_$2" ;;
    redis) echo "redis_$2" ;;
    kafka) echo "kafka_$2" ;;
    mariadb) echo "mdb_$2" ;;
    *)
        # Services from scripts/services.d/*.sh: functions named <service>_<action>
        # with '-' as '_' (e.g. kafka-cluster -> kafka_cluster_start).
        local f="${1//-/_}_$2"
        declare -F "$f" >/dev/null || die "unknown service '$1' (expected one of: ${ALL_SERVICES[*]})"
        echo "$f"
        ;;
    esac
}

validate_services() {
    local s ok
    for s in "$@"; do
        ok=0
        for a in "${ALL_SERVICES[@]}"; do [[ $s == "$a" ]] && ok=1; done
        ((ok)) || die "unknown service '$s' (expected one of: ${ALL_SERVICES[*]})"
    done
}

take_lock() {
    mkdir -p "$STATE_DIR"
    exec 9>"$STATE_DIR/.services.lock"
    flock -w 900 9 || die "timed out waiting for another services.sh on $STATE_DIR"
}

cmd_env() {
    cat <<EOF
export MQDEDUP_TEST_DATABASE_URL=postgresql+psycopg://mqdedup:mqdedup@$HOST:$PG_PORT/mqdedup
export MQDEDUP_RABBITMQ_URL=amqp://guest:guest@$HOST:$RABBITMQ_PORT/%2F
export MQDEDUP_RABBITMQCTL='$RABBITMQCTL -n $RABBITMQ_NODE'
export MQDEDUP_REDIS_URL=redis://$HOST:$REDIS_PORT/0
export MQDEDUP_KAFKA_BOOTSTRAP=$HOST:$KAFKA_PORT
export MQDEDUP_KAFKA_LIBS=$KAFKA_LIBS
export MQDEDUP_SERVICES_SH=$SCRIPT_PATH
EOF
    if port_open "$MARIADB_PORT"; then
        echo "export MQDEDUP_TEST_MARIADB_URL=mysql+pymysql://mqdedup:mqdedup@$HOST:$MARIADB_PORT/mqdedup"
    else
        echo "# MQDEDUP_TEST_MARIADB_URL unset: nothing listens on $HOST:$MARIADB_PORT ('$SCRIPT_PATH start mariadb' to run it)"
    fi
    local hook
    for hook in "${EXTRA_ENV_HOOKS[@]}"; do "$hook"; done
}

cmd_logs() {
    local f files=()
    case ${1:-} in
    postgres) files=("$PG_LOG") ;;
    rabbitmq) files=("$RMQ_OUT" "$RMQ_LOG") ;;
    redis) files=("$REDIS_LOG") ;;
    kafka) files=("$KAFKA_OUT" "$KAFKA_LOG") ;;
    mariadb) files=("$MDB_INST/mariadb.out" "$MDB_LOG") ;;
    *)
        declare -F "${1//-/_}_logfiles" >/dev/null || die "usage: $0 logs SERVICE"
        mapfile -t files < <("${1//-/_}_logfiles")
        ;;
    esac
    for f in "${files[@]}"; do
        echo "==== $f"
        if [[ -f $f ]]; then tail -n 60 "$f"; else echo "(missing)"; fi
    done
}

usage() {
    sed -n '2,23p' "$SCRIPT_PATH" | sed 's/^# \{0,1\}//'
}

# The browser the console's tests drive (Playwright with the system browser: its own
# download is not needed). Installed from Debian when missing.
ensure_browser() {
    if [[ -x /usr/bin/chromium ]]; then return 0; fi
    apt_install chromium
    [[ -x /usr/bin/chromium ]] || die "chromium installed, but /usr/bin/chromium is missing"
}

main() {
    local cmd=${1:-}
    [[ $# -gt 0 ]] && shift
    local services=("$@") s t0
    case $cmd in
    start | restart)
        ((${#services[@]})) || services=("${DEFAULT_SERVICES[@]}")
        validate_services "${services[@]}"
        take_lock
        t0=$(now)
        if [[ $cmd == restart ]]; then
            for s in "${services[@]}"; do "$(svc_fn "$s" stop)"; done
        fi
        for s in "${services[@]}"; do "$(svc_fn "$s" start)"; done
        log "all requested services are up (${services[*]}; $(elapsed "$t0")); '$SCRIPT_PATH env' prints the URLs"
        ;;
    stop)
        if ((${#services[@]} == 0)); then
            services=("${DEFAULT_SERVICES[@]}")
            mdb_managed && services+=(mariadb)
        fi
        validate_services "${services[@]}"
        take_lock
        for s in "${services[@]}"; do "$(svc_fn "$s" stop)"; done
        ;;
    kill)
        ((${#services[@]})) || die "usage: $0 kill SERVICE..."
        validate_services "${services[@]}"
        take_lock
        for s in "${services[@]}"; do "$(svc_fn "$s" kill)"; done
        ;;
    status)
        ((${#services[@]})) || services=("${DEFAULT_SERVICES[@]}")
        validate_services "${services[@]}"
        for s in "${services[@]}"; do "$(svc_fn "$s" status)"; done
        ;;
    env) cmd_env ;;
    browser) ensure_browser ;;
    dist-port) rmq_free_dist_port $((${1:-$RABBITMQ_PORT} + 20000)) "${@:2}" ;;
    logs) cmd_logs "${services[@]}" ;;
    -h | --help | help) usage ;;
    *)
        usage >&2
        exit 2
        ;;
    esac
}

main "$@"
