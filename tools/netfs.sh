#!/bin/bash
# A real network filesystem for tests and CI: an export folder served by a private sshd on loopback and mounted
# twice with sshfs (FUSE), as two "client nodes" would mount one NFS export. sshfs caches attributes and
# directory listings per mount (like NFS's actimeo / lookupcache) and renames through SFTP's posix-rename:
# closer to NFS than a local disk.
#
#   tools/netfs.sh start [--hide-caches S]
#                           install openssh-server + sshfs when missing (root), start sshd, mount A and B (idempotent);
#                           --hide-caches S: mounts whose caches hide new entries, deleted entries and changed
#                           attributes for S seconds (dcache_timeout, entry_timeout, attr_timeout, negative_timeout;
#                           docs/netfs.md, "Cache-hiding mounts"); remount (stop, start) to change it
#   tools/netfs.sh stop     unmount both, stop only the sshd started here (its PID file)
#   tools/netfs.sh status   exit 0 when both mounts answer
#   tools/netfs.sh env      print the line to source:  eval "$(tools/netfs.sh env)"
#
# Everything (host keys, client key, sshd config and log, PID file, export) lives under $NETFS_DIR. The sshd listens
# on 127.0.0.1 only, takes keys only (no passwords), and uses its own config: the machine's sshd is untouched.
#
# Knobs (environment):
#   NETFS_DIR      base dir                                          (default /tmp/relax-netfs)
#   NETFS_PORT     sshd port on 127.0.0.1                            (default 22722)
#   NETFS_OPTS     sshfs -o options of both mounts (see docs/netfs.md) (default: sshfs's caching, as NFS would)
#   NETFS_HIDE_S   as --hide-caches S                                (default: unset)
set -euo pipefail
DIR=${NETFS_DIR:-/tmp/relax-netfs}
PORT=${NETFS_PORT:-22722}
OPTS=${NETFS_OPTS:-cache=yes,cache_timeout=20,transform_symlinks,no_contain_symlinks,reconnect,ServerAliveInterval=5,ServerAliveCountMax=3}
if [ "${1:-}" = start ] && [ "${2:-}" = --hide-caches ]; then
  NETFS_HIDE_S=${3:?"--hide-caches needs a number of seconds"}
fi
if [ -n "${NETFS_HIDE_S:-}" ]; then
  if ! [[ "$NETFS_HIDE_S" =~ ^[0-9]+([.][0-9]+)?$ ]]; then
    echo "error: --hide-caches / NETFS_HIDE_S must be a number of seconds, got '$NETFS_HIDE_S'" >&2; exit 2
  fi
  H=$NETFS_HIDE_S
  OPTS="$OPTS,cache_timeout=${H%.*},dcache_timeout=${H%.*},entry_timeout=$H,attr_timeout=$H,ac_attr_timeout=$H,negative_timeout=$H"
fi
EXPORT=$DIR/export
MNT_A=$DIR/a
MNT_B=$DIR/b
PIDFILE=$DIR/sshd.pid

log() { echo "[netfs] $*" >&2; }

mounted() { mountpoint -q "$1" 2>/dev/null; }

# A FUSE mount whose sshfs died ("Transport endpoint is not connected": a crashed or killed earlier run) still sits
# in the mount table and makes mkdir/ls fail; detach it lazily so this run can mount afresh.
clear_stale() {
  local mnt=$1
  if grep -q " $mnt fuse" /proc/mounts && ! ls "$mnt" >/dev/null 2>&1; then
    log "detaching stale mount $mnt"
    fusermount -uz "$mnt" 2>/dev/null || umount -l "$mnt"
  fi
}

sshd_alive() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

install_packages() {
  if command -v sshfs >/dev/null && [ -x /usr/sbin/sshd ]; then return; fi
  if [ "$(id -u)" != 0 ]; then log "sshfs/sshd missing and not root: cannot install"; exit 1; fi
  log "installing openssh-server sshfs"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server sshfs >/dev/null
}

write_config() {
  clear_stale "$MNT_A"
  clear_stale "$MNT_B"
  mkdir -p "$DIR" "$EXPORT" "$MNT_A" "$MNT_B"
  chmod 700 "$DIR"
  [ -f "$DIR/host_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -f "$DIR/host_ed25519"
  [ -f "$DIR/client_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -f "$DIR/client_ed25519"
  cp "$DIR/client_ed25519.pub" "$DIR/authorized_keys"
  chmod 600 "$DIR/authorized_keys"
  cat > "$DIR/sshd_config" <<EOF
Port $PORT
ListenAddress 127.0.0.1
HostKey $DIR/host_ed25519
PidFile $PIDFILE
AuthorizedKeysFile $DIR/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
Subsystem sftp internal-sftp
LogLevel ERROR
EOF
}

start_sshd() {
  if sshd_alive; then return; fi
  mkdir -p /run/sshd
  /usr/sbin/sshd -f "$DIR/sshd_config" -E "$DIR/sshd.log"
  for _ in $(seq 50); do sshd_alive && return; sleep 0.1; done
  log "sshd did not start; see $DIR/sshd.log"; exit 1
}

mount_one() {
  local mnt=$1
  if mounted "$mnt"; then return; fi
  sshfs -p "$PORT" "root@127.0.0.1:$EXPORT" "$mnt" \
    -o "IdentityFile=$DIR/client_ed25519,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,LogLevel=ERROR" \
    -o "$OPTS"
}

case "${1:-}" in
  start)
    install_packages
    write_config
    start_sshd
    mount_one "$MNT_A"
    mount_one "$MNT_B"
    log "export $EXPORT mounted at $MNT_A and $MNT_B (sshd pid $(cat "$PIDFILE"), port $PORT)"
    ;;
  stop)
    for m in "$MNT_A" "$MNT_B"; do
      clear_stale "$m"
      if mounted "$m"; then fusermount -u "$m" 2>/dev/null || umount "$m"; fi
    done
    if sshd_alive; then kill "$(cat "$PIDFILE")"; fi
    rm -f "$PIDFILE"
    ;;
  status)
    mounted "$MNT_A" && mounted "$MNT_B" && sshd_alive && ls "$MNT_A" >/dev/null && echo "netfs up: $MNT_A $MNT_B"
    ;;
  env)
    echo "export RELAX_NETFS_A=$MNT_A RELAX_NETFS_B=$MNT_B"
    ;;
  *)
    echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
