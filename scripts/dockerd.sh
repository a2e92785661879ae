#!/usr/bin/env bash
# A Docker engine confined to /tmp/minirsi-docker, for the Docker sandbox backend and its tests.
#
#   bash scripts/dockerd.sh start   start dockerd (if not running), wait until it answers, and
#                                   import the base image minirsi-base:bookworm from the rootfs
#   eval "$(bash scripts/dockerd.sh env)"   point the docker CLI/SDK at it (DOCKER_HOST)
#   bash scripts/dockerd.sh stop    stop it by the PID in its pid file
#
# Networking is switched off at the daemon (--bridge=none, no iptables, no forwarding, no
# masquerading): the defaults would create docker0 and rewrite the host's iptables rules.
# Containers get no network at all (the backend also runs them with network_mode=none).
set -euo pipefail

DIR="${MINIRSI_DOCKER_DIR:-/tmp/minirsi-docker}"
SOCK="$DIR/docker.sock"
PIDFILE="$DIR/dockerd.pid"
ROOTFS="${MINIRSI_ROOTFS:-$HOME/.cache/minirsi/rootfs}"
IMAGE="minirsi-base:bookworm"
export DOCKER_HOST="unix://$SOCK"

running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

case "${1:-}" in
  start)
    command -v dockerd >/dev/null || { echo "[dockerd.sh] dockerd not found: apt-get install docker.io" >&2; exit 1; }
    mkdir -p "$DIR/data" "$DIR/exec"
    if ! running; then
      # containerd comes with docker.io; dockerd starts its own under --exec-root when none answers.
      nohup dockerd --host "$DOCKER_HOST" --data-root "$DIR/data" --exec-root "$DIR/exec" \
        --pidfile "$PIDFILE" --bridge=none --iptables=false --ip6tables=false --ip-forward=false \
        --ip-masq=false --userland-proxy=false \
        >"$DIR/dockerd.log" 2>&1 &
      for _ in $(seq 1 120); do
        docker version >/dev/null 2>&1 && break
        if ! kill -0 $! 2>/dev/null; then echo "[dockerd.sh] dockerd exited; see $DIR/dockerd.log:" >&2; tail -20 "$DIR/dockerd.log" >&2; exit 1; fi
        sleep 0.5
      done
    fi
    docker version >/dev/null 2>&1 || { echo "[dockerd.sh] dockerd does not answer on $SOCK; see $DIR/dockerd.log" >&2; exit 1; }
    if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
      [ -x "$ROOTFS/usr/bin/python3" ] || { echo "[dockerd.sh] no rootfs at $ROOTFS: run scripts/setup.sh" >&2; exit 1; }
      echo "[dockerd.sh] importing $IMAGE from $ROOTFS"
      tar -C "$ROOTFS" -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
    fi
    echo "[dockerd.sh] ready: DOCKER_HOST=$DOCKER_HOST"
    ;;
  env)
    echo "export DOCKER_HOST=$DOCKER_HOST"
    ;;
  stop)
    if running; then
      pid="$(cat "$PIDFILE")"
      kill "$pid"
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
      echo "[dockerd.sh] stopped dockerd (pid $pid)"
    else
      echo "[dockerd.sh] not running"
    fi
    ;;
  *)
    echo "usage: bash scripts/dockerd.sh start|env|stop" >&2
    exit 2
    ;;
esac
