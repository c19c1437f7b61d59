# shellcheck shell=bash
# Broker clusters on loopback (sourced by scripts/services.sh; never started by default).
#
#   scripts/services.sh start kafka-cluster        # three KRaft brokers (combined roles), RF=3
#   scripts/services.sh start rabbitmq-cluster     # three RabbitMQ nodes joined in one cluster
#   scripts/services.sh kill  kafka-cluster-2      # SIGKILL ONE node (crash tests) ...
#   scripts/services.sh start kafka-cluster-2      # ... and bring it back with its data
#   scripts/services.sh stop  kafka-cluster rabbitmq-cluster
#
# Same for rabbitmq-cluster-1..3.  `env` prints MQDEDUP_KAFKA_CLUSTER_BOOTSTRAP (comma list),
# MQDEDUP_RABBITMQ_CLUSTER_URLS (comma list of AMQP URLs, node 1 first) and
# MQDEDUP_RABBITMQ_CLUSTER_NODES (Erlang node names, same order).
#
# Knobs: KAFKA_CLUSTER_PORT (19092: brokers on 19092/19094/19096, controllers on the port + 1),
# KAFKA_CLUSTER_HEAP_OPTS ("-Xmx384m -Xms128m"), RABBITMQ_CLUSTER_PORT (5681: AMQP on
# 5681/5682/5683, nodes rabbit-<port>@localhost, Erlang distribution on <port>+20000 unless
# taken or in the ephemeral port range: rmq_free_dist_port in scripts/services.sh).
# Data: "$MQDEDUP_STATE_DIR/kafka-cluster-<port>/node<N>" and "$MQDEDUP_STATE_DIR/rabbitmq-cluster-<port>/node<N>".
# The single-node services (kafka on 9092, rabbitmq on 5672) are never touched.

KC_BASE=${KAFKA_CLUSTER_PORT:-19092}
KC_HEAP_OPTS=${KAFKA_CLUSTER_HEAP_OPTS:--Xmx384m -Xms128m}
KC_DIR="$STATE_DIR/kafka-cluster-$KC_BASE"
KC_NODES=(1 2 3)

RC_BASE=${RABBITMQ_CLUSTER_PORT:-5681}
RC_DIR="$STATE_DIR/rabbitmq-cluster-$RC_BASE"

ALL_SERVICES+=(kafka-cluster kafka-cluster-1 kafka-cluster-2 kafka-cluster-3
    rabbitmq-cluster rabbitmq-cluster-1 rabbitmq-cluster-2 rabbitmq-cluster-3)

# ----------------------------------------------------------------------------- kafka cluster

kc_port() { echo $((KC_BASE + 2 * ($1 - 1))); }
kc_cport() { echo $((KC_BASE + 2 * ($1 - 1) + 1)); }
kc_inst() { echo "$KC_DIR/node$1"; }
kc_pat() { echo "kafka.Kafka $(kc_inst "$1")/server.properties"; }
kc_pid() { read_pid "$(kc_inst "$1")/kafka.pid"; }
kc_managed() { pid_alive "$(kc_pid "$1")" "$(kc_pat "$1")"; }
kc_bootstrap() {
    local n out=()
    for n in "${KC_NODES[@]}"; do out+=("$HOST:$(kc_port "$n")"); done
    (IFS=,; echo "${out[*]}")
}

kc_write_conf() { # NODE
    local n=$1 inst voters="" m
    inst=$(kc_inst "$n")
    for m in "${KC_NODES[@]}"; do voters+="${voters:+,}$m@$HOST:$(kc_cport "$m")"; done
    mkdir -p "$inst/data"
    cat >"$inst/server.properties" <<EOF
# Written by scripts/services.d/clusters.sh on every start; edits are lost.
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$voters
listeners=PLAINTEXT://$HOST:$(kc_port "$n"),CONTROLLER://$HOST:$(kc_cport "$n")
advertised.listeners=PLAINTEXT://$HOST:$(kc_port "$n")
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$inst/data
num.partitions=1
default.replication.factor=3
min.insync.replicas=2
auto.create.topics.enable=true
delete.topic.enable=true
offsets.topic.replication.factor=3
offsets.topic.min.isr=2
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
# Never elect an out-of-sync replica: a leader change must not lose acknowledged records.
unclean.leader.election.enable=false
# A restarted broker takes its preferred partitions back within seconds (tests watch that).
auto.leader.rebalance.enable=true
leader.imbalance.check.interval.seconds=10
broker.session.timeout.ms=6000
broker.heartbeat.interval.ms=1000
replica.lag.time.max.ms=10000
num.network.threads=2
num.io.threads=2
num.replica.fetchers=1
num.recovery.threads.per.data.dir=1
background.threads=2
log.retention.hours=168
EOF
    kafka_write_log4j "$inst" "$inst/kafka.log"
}

kc_tool() { # NODE CLASS ARGS...: short-lived JVM on the broker classpath
    local inst
    inst=$(kc_inst "$1")
    shift
    timeout 90 "$(java_bin)" -Xmx128m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
        -Dlog4j2.configurationFile="$inst/log4j2-tools.properties" \
        -cp "$KAFKA_LIBS/*" "$@" 9>&-
}

# The number of brokers NODE's metadata lists (registered and unfenced).
kc_brokers_seen() { # NODE
    kc_tool "$1" org.apache.kafka.tools.BrokerApiVersionsCommand \
        --bootstrap-server "$HOST:$(kc_port "$1")" 2>/dev/null | grep -c '(id: ' || true
}

kc_launch() { # NODE (already configured and formatted)
    local n=$1 inst java
    inst=$(kc_inst "$n")
    java=$(java_bin)
    log "kafka-cluster-$n: starting KRaft broker+controller node.id=$n on $HOST:$(kc_port "$n") (controller $HOST:$(kc_cport "$n"), data $inst/data)"
    printf '\n==== %s starting kafka.Kafka ====\n' "$(date -u +%FT%TZ)" >>"$inst/kafka.out"
    (
        cd "$inst"
        # shellcheck disable=SC2086  # KC_HEAP_OPTS is a list of JVM flags
        setsid "$java" $KC_HEAP_OPTS -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
            -XX:ParallelGCThreads=1 -XX:ConcGCThreads=1 -XX:CICompilerCount=2 \
            -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true -Dkafka.logs.dir="$inst" \
            -Dlog4j2.configurationFile="$inst/log4j2.properties" \
            -cp "$KAFKA_LIBS/*" kafka.Kafka "$inst/server.properties" \
            >>"$inst/kafka.out" 2>&1 </dev/null 9>&- &
        echo $! >"$inst/kafka.pid"
    )
}

kc_prepare() { # NODE: config + storage format (once, with the cluster's id)
    local n=$1 inst
    inst=$(kc_inst "$n")
    mkdir -p "$inst"
    kc_write_conf "$n"
    if [[ ! -s $inst/data/meta.properties ]]; then
        log "kafka-cluster-$n: formatting $inst/data (cluster id $(cat "$KC_DIR/cluster.id"))"
        kc_tool "$n" kafka.tools.StorageTool format -t "$(cat "$KC_DIR/cluster.id")" \
            -c "$inst/server.properties" --ignore-formatted >>"$inst/kafka.out" 2>&1 ||
            fail_start "kafka-cluster-$n" "storage format failed" "$inst/kafka.out"
    fi
}

# Waits until NODE answers and its metadata lists all three brokers.
kc_wait_ready() { # NODE DEADLINE
    local n=$1 deadline=$2 inst port
    inst=$(kc_inst "$n")
    port=$(kc_port "$n")
    until port_open "$port"; do
        (($(date +%s) < deadline)) || fail_start "kafka-cluster-$n" "port $HOST:$port not open after ${START_TIMEOUT}s" "$inst/kafka.out" "$inst/kafka.log"
        kc_managed "$n" || fail_start "kafka-cluster-$n" "broker exited during startup" "$inst/kafka.out" "$inst/kafka.log"
        sleep 0.3
    done
    until [[ $(kc_brokers_seen "$n") -ge ${#KC_NODES[@]} ]]; do
        (($(date +%s) < deadline)) || fail_start "kafka-cluster-$n" "metadata from $HOST:$port does not list ${#KC_NODES[@]} brokers after ${START_TIMEOUT}s" "$inst/kafka.out" "$inst/kafka.log"
        kc_managed "$n" || fail_start "kafka-cluster-$n" "broker exited during startup" "$inst/kafka.out" "$inst/kafka.log"
        sleep 1
    done
}

kc_start_nodes() { # NODE...
    local t0 n deadline started=()
    t0=$(now)
    need_root "starting kafka-cluster"
    kafka_install
    mkdir -p "$KC_DIR"
    [[ -s $KC_DIR/cluster.id ]] ||
        head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n' | sed 's/^-/A/' >"$KC_DIR/cluster.id"
    for n in "$@"; do
        if kc_managed "$n"; then
            log "kafka-cluster-$n: already running on $HOST:$(kc_port "$n") (pid $(kc_pid "$n"))"
            continue
        fi
        port_open "$(kc_port "$n")" && die "kafka-cluster-$n: $HOST:$(kc_port "$n") is taken by something this state dir did not start"
        port_open "$(kc_cport "$n")" && die "kafka-cluster-$n: controller port $HOST:$(kc_cport "$n") is taken"
        kc_prepare "$n"
        kc_launch "$n"
        started+=("$n")
    done
    deadline=$(($(date +%s) + START_TIMEOUT))
    for n in "$@"; do kc_wait_ready "$n" "$deadline"; done
    log "kafka-cluster: node(s) $* up, bootstrap $(kc_bootstrap) ($(elapsed "$t0"))"
}

kc_stop_node() { # NODE
    local n=$1 pid pat
    pid=$(kc_pid "$n")
    pat=$(kc_pat "$n")
    if ! pid_alive "$pid" "$pat"; then
        log "kafka-cluster-$n: already stopped"
        return
    fi
    log "kafka-cluster-$n: stopping (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_pid_gone "$pid" "$pat" 60; then
        log "kafka-cluster-$n: did not stop within 60s; killing it"
        kc_kill_node "$n"
        return
    fi
    wait_pids_exited 30 "$pid" || true
    wait_port_closed "$(kc_port "$n")" 10 || true
    log "kafka-cluster-$n: stopped"
}

kc_kill_node() { # NODE
    local n=$1 pid pat
    pid=$(kc_pid "$n")
    pat=$(kc_pat "$n")
    if ! pid_alive "$pid" "$pat"; then
        log "kafka-cluster-$n: not running (nothing to kill)"
        return
    fi
    log "kafka-cluster-$n: SIGKILL pid $pid"
    kill -9 "$pid" 2>/dev/null || true
    wait_pid_gone "$pid" "$pat" 30 || die "kafka-cluster-$n: pid $pid survived SIGKILL"
    wait_pids_exited 30 "$pid" || log "kafka-cluster-$n: still exiting"
    wait_port_closed "$(kc_port "$n")" 10 || true
}

kc_status_node() { # NODE
    local n=$1
    if port_open "$(kc_port "$n")" && kc_managed "$n"; then
        echo "kafka-cluster-$n: up ($HOST:$(kc_port "$n"), node.id $n, pid $(kc_pid "$n"))"
    elif kc_managed "$n"; then
        echo "kafka-cluster-$n: down ($HOST:$(kc_port "$n"), pid $(kc_pid "$n") alive but port closed)"
    else
        echo "kafka-cluster-$n: down ($HOST:$(kc_port "$n"))"
    fi
}

kafka_cluster_start() { kc_start_nodes "${KC_NODES[@]}"; }
kafka_cluster_stop() {
    local n pids=()
    # In parallel: stopping one after the other makes each remaining quorum wait for the last.
    for n in "${KC_NODES[@]}"; do
        kc_stop_node "$n" &
        pids+=($!)
    done
    for n in "${pids[@]}"; do wait "$n" || true; done
}
kafka_cluster_kill() { local n; for n in "${KC_NODES[@]}"; do kc_kill_node "$n"; done; }
kafka_cluster_status() { local n; for n in "${KC_NODES[@]}"; do kc_status_node "$n"; done; }
kafka_cluster_logfiles() { local n; for n in "${KC_NODES[@]}"; do printf '%s\n' "$(kc_inst "$n")/kafka.out" "$(kc_inst "$n")/kafka.log"; done; }

for _n in "${KC_NODES[@]}"; do
    eval "kafka_cluster_${_n}_start() { kc_start_nodes $_n; }
kafka_cluster_${_n}_stop() { kc_stop_node $_n; }
kafka_cluster_${_n}_kill() { kc_kill_node $_n; }
kafka_cluster_${_n}_status() { kc_status_node $_n; }
kafka_cluster_${_n}_logfiles() { printf '%s\n' \"\$(kc_inst $_n)/kafka.out\" \"\$(kc_inst $_n)/kafka.log\"; }"
done

# ----------------------------------------------------------------------------- rabbitmq cluster

rc_port() { echo $((RC_BASE + $1 - 1)); }
rc_dist() { cat "$(rc_inst "$1")/dist.port"; } # picked by rc_write_conf (rmq_free_dist_port)
rc_node() { echo "rabbit-$(rc_port "$1")@localhost"; }
rc_inst() { echo "$RC_DIR/node$1"; }
rc_beam_pid() { read_pid "$(rc_inst "$1")/rabbitmq.pid"; }
rc_launcher_pid() { read_pid "$(rc_inst "$1")/launcher.pid"; }
rc_managed() { pid_alive "$(rc_beam_pid "$1")" "rabbit boot" || pid_alive "$(rc_launcher_pid "$1")" rabbitmq-server; }
rc_ctl() { # NODE ARGS...
    local n=$1
    shift
    timeout 120 "$RABBITMQCTL" -n "$(rc_node "$n")" "$@" 9>&-
}
rc_urls() {
    local n out=()
    for n in 1 2 3; do out+=("amqp://guest:guest@$HOST:$(rc_port "$n")/%2F"); done
    (IFS=,; echo "${out[*]}")
}

rc_write_conf() { # NODE
    local n=$1 inst
    inst=$(rc_inst "$n")
    mkdir -p "$inst/log" "$inst/mnesia"
    local other taken=()
    for other in 1 2 3; do # ports promised to the other nodes (maybe not bound yet)
        ((other != n)) && [[ -r $(rc_inst "$other")/dist.port ]] && taken+=("$(rc_dist "$other")")
    done
    rmq_free_dist_port $(($(rc_port "$n") + 20000)) "${taken[@]}" >"$inst/dist.port" ||
        die "rabbitmq-cluster-$n: no free Erlang distribution port found"
    cat >"$inst/rabbitmq.conf" <<EOF
# Written by scripts/services.d/clusters.sh on every start; edits are lost.
listeners.tcp.1 = $HOST:$(rc_port "$n")
distribution.listener.interface = $HOST
distribution.listener.port_range.min = $(rc_dist "$n")
distribution.listener.port_range.max = $(rc_dist "$n")
loopback_users.guest = true
log.console = false
log.file = $inst/log/rabbit.log
log.file.level = info
disk_free_limit.absolute = 50MB
vm_memory_high_watermark.absolute = 512MB
# A peer that stops answering is declared down after ~15 s (default 60 s).
net_ticktime = 15
cluster_partition_handling = pause_minority
EOF
    printf '[].\n' >"$inst/enabled_plugins"
    : >"$inst/rabbitmq-env.conf"
}

rc_launch() { # NODE
    local n=$1 inst node
    inst=$(rc_inst "$n")
    node=$(rc_node "$n")
    rm -f "$inst/rabbitmq.pid"
    log "rabbitmq-cluster-$n: starting node $node on $HOST:$(rc_port "$n") (dist port $(rc_dist "$n"), data $inst/mnesia)"
    # One scheduler, no busy-waiting: three idle nodes must not eat a 2-core machine.
    rmq_launch "$node" "$inst" "$(rc_port "$n")" "$(rc_dist "$n")" "$inst/log/rabbit.log" \
        "$inst/server.out" "+S 1:1 +sbwt none +sbwtdcpu none +sbwtdio none"
}

rc_wait_ready() { # NODE DEADLINE
    local n=$1 deadline=$2 inst
    inst=$(rc_inst "$n")
    until port_open "$(rc_port "$n")"; do
        (($(date +%s) < deadline)) || fail_start "rabbitmq-cluster-$n" "AMQP port $HOST:$(rc_port "$n") not open after ${START_TIMEOUT}s" "$inst/server.out" "$inst/log/rabbit.log"
        rc_managed "$n" || fail_start "rabbitmq-cluster-$n" "node exited during startup" "$inst/server.out" "$inst/log/rabbit.log"
        sleep 0.3
    done
    rc_ctl "$n" await_startup --timeout "$START_TIMEOUT" >/dev/null 2>&1 ||
        fail_start "rabbitmq-cluster-$n" "'rabbitmqctl -n $(rc_node "$n") await_startup' failed" "$inst/server.out" "$inst/log/rabbit.log"
}

# NODE (2 or 3) joins node 1's cluster unless it already is a member.
rc_join() { # NODE
    local n=$1 status
    status=$(rc_ctl "$n" cluster_status --formatter json 2>/dev/null || true)
    if [[ $status == *"\"$(rc_node 1)\""* ]]; then return 0; fi
    log "rabbitmq-cluster-$n: joining $(rc_node 1)"
    rc_ctl "$n" stop_app >/dev/null &&
        rc_ctl "$n" join_cluster "$(rc_node 1)" >>"$(rc_inst "$n")/server.out" 2>&1 &&
        rc_ctl "$n" start_app >/dev/null ||
        fail_start "rabbitmq-cluster-$n" "could not join $(rc_node 1)" "$(rc_inst "$n")/server.out" "$(rc_inst "$n")/log/rabbit.log"
}

rc_start_nodes() { # NODE...
    local t0 n deadline
    t0=$(now)
    need_root "starting rabbitmq-cluster"
    rmq_install
    for n in "$@"; do
        if rc_managed "$n"; then
            log "rabbitmq-cluster-$n: already running as $(rc_node "$n") (pid $(rc_beam_pid "$n"))"
            continue
        fi
        port_open "$(rc_port "$n")" && die "rabbitmq-cluster-$n: $HOST:$(rc_port "$n") is taken by something this state dir did not start"
        rc_write_conf "$n"
        rc_launch "$n"
    done
    deadline=$(($(date +%s) + START_TIMEOUT))
    for n in "$@"; do rc_wait_ready "$n" "$deadline"; done
    for n in "$@"; do if ((n != 1)); then rc_join "$n"; fi; done
    log "rabbitmq-cluster: node(s) $* up, URLs $(rc_urls) ($(elapsed "$t0"))"
}

rc_stop_node() { # NODE
    local n=$1 lpid bpid
    if ! rc_managed "$n"; then
        log "rabbitmq-cluster-$n: already stopped"
        return
    fi
    lpid=$(rc_launcher_pid "$n")
    bpid=$(rc_beam_pid "$n")
    log "rabbitmq-cluster-$n: stopping $(rc_node "$n") (pid ${bpid:-?})"
    if ! rc_ctl "$n" shutdown >/dev/null 2>&1; then
        if [[ -n $bpid ]]; then kill -TERM "$bpid" 2>/dev/null || true; fi
    fi
    if ! wait_pid_gone "$bpid" "rabbit boot" 60 || ! wait_pid_gone "$lpid" rabbitmq-server 10; then
        rc_kill_node "$n"
        return
    fi
    wait_pids_exited 30 "$bpid" "$lpid" || true
    wait_port_closed "$(rc_port "$n")" 10 || true
    log "rabbitmq-cluster-$n: stopped"
}

rc_kill_node() { # NODE
    local n=$1 lpid bpid
    lpid=$(rc_launcher_pid "$n")
    bpid=$(rc_beam_pid "$n")
    if ! rc_managed "$n"; then
        log "rabbitmq-cluster-$n: not running (nothing to kill)"
        return
    fi
    log "rabbitmq-cluster-$n: SIGKILL node $(rc_node "$n") (pid ${bpid:-?}, launcher ${lpid:-?})"
    if pid_alive "$lpid" rabbitmq-server; then kill -9 -- "-$lpid" 2>/dev/null || true; fi
    if pid_alive "$bpid" "rabbit boot"; then kill -9 "$bpid" 2>/dev/null || true; fi
    wait_pid_gone "$bpid" "rabbit boot" 30 || die "rabbitmq-cluster-$n: pid $bpid survived SIGKILL"
    wait_pids_exited 30 "$bpid" "$lpid" || log "rabbitmq-cluster-$n: node is still exiting"
    wait_port_closed "$(rc_port "$n")" 10 || true
}

rc_status_node() { # NODE
    local n=$1
    if port_open "$(rc_port "$n")" && rc_managed "$n"; then
        echo "rabbitmq-cluster-$n: up ($HOST:$(rc_port "$n"), node $(rc_node "$n"), pid $(rc_beam_pid "$n"))"
    else
        echo "rabbitmq-cluster-$n: down ($HOST:$(rc_port "$n"), node $(rc_node "$n"))"
    fi
}

rabbitmq_cluster_start() { rc_start_nodes 1 2 3; }
rabbitmq_cluster_stop() {
    # Node 1 last: a cluster restarts cleanly from the node that stopped last.
    rc_stop_node 3
    rc_stop_node 2
    rc_stop_node 1
}
rabbitmq_cluster_kill() { local n; for n in 1 2 3; do rc_kill_node "$n"; done; }
rabbitmq_cluster_status() { local n; for n in 1 2 3; do rc_status_node "$n"; done; }
rabbitmq_cluster_logfiles() { local n; for n in 1 2 3; do printf '%s\n' "$(rc_inst "$n")/server.out" "$(rc_inst "$n")/log/rabbit.log"; done; }

for _n in 1 2 3; do
    eval "rabbitmq_cluster_${_n}_start() { rc_start_nodes $_n; }
rabbitmq_cluster_${_n}_stop() { rc_stop_node $_n; }
rabbitmq_cluster_${_n}_kill() { rc_kill_node $_n; }
rabbitmq_cluster_${_n}_status() { rc_status_node $_n; }
rabbitmq_cluster_${_n}_logfiles() { printf '%s\n' \"\$(rc_inst $_n)/server.out\" \"\$(rc_inst $_n)/log/rabbit.log\"; }"
done
unset _n

clusters_env() {
    echo "export MQDEDUP_KAFKA_CLUSTER_BOOTSTRAP=$(kc_bootstrap)"
    echo "export MQDEDUP_RABBITMQ_CLUSTER_URLS='$(rc_urls)'"
    echo "export MQDEDUP_RABBITMQ_CLUSTER_NODES=$(rc_node 1),$(rc_node 2),$(rc_node 3)"
}
EXTRA_ENV_HOOKS+=(clusters_env)
