#!/bin/bash
# A real, single-machine Slurm cluster for tests, the demo and CI:
#   munged + [mariadbd + slurmdbd] + slurmctld + N x slurmd (logical nodes node1..nodeN), all run as root.
#
#   tools/slurm_local.sh start    install Debian packages when missing, write config, start what is not running,
#                                 wait until every node is idle (idempotent)
#   tools/slurm_local.sh stop     cancel this cluster's jobs (by id), stop only the daemons started here (PID files)
#   tools/slurm_local.sh status   print which daemons run and `sinfo`; exit 0 only when the cluster answers
#   tools/slurm_local.sh env      print the line to source:  eval "$(tools/slurm_local.sh env)"
#
# Everything (config, munge key, state, logs, PID files, accounting DB) lives under $SLURM_LOCAL_DIR.
# Clients must see the config:  source $SLURM_LOCAL_DIR/slurm.env   (it exports SLURM_CONF).
#
# Knobs (environment):
#   SLURM_LOCAL_DIR   base dir                                            (default /tmp/relax-slurm)
#   SLURM_NODES       logical nodes node[1-N], one slurmd each            (default 4)
#   SLURM_CPUS        CPUs declared per node (may exceed real cores)      (default 4: several steps fit on a node)
#   SLURM_ACCOUNTING  1 = mariadb + slurmdbd so that sacct works          (default 1)
#   SLURM_RESET       1 = stop, wipe controller state + accounting DB, then start fresh (default 0)
#   SLURM_CTLD_PORT, SLURM_DBD_PORT, SLURM_MYSQL_PORT, SLURM_NODE_PORT0   ports (6917, 6919, 13406, 17101)
#   SLURM_WAIT_S      how long to wait for each daemon / the nodes        (default 60)
#
# Pitfalls this script avoids (Slurm 22.05 on Debian 12, no systemd):
#   * apt's policy-rc.d keeps packages from starting system-wide services; daemons are started by hand here.
#   * CgroupPlugin=disabled fails in 22.05: use autodetect + IgnoreSystemd=yes.
#   * hetjobs are started only by the backfill scheduler, arrays and requeues are slow without short intervals:
#     SchedulerParameters=bf_interval=1,sched_interval=2,batch_sched_delay=0,sched_min_interval=0.
#   * munged as root refuses a key owned by the munge user: a root-owned key is generated here.
#   * without slurmdbd, sacct fails ("accounting storage is disabled"); a finished job takes ~1 s to appear in it.
#   * editing slurm.conf while daemons run makes nodes disagree with slurmctld: a changed config restarts all.
set -euo pipefail

D=${SLURM_LOCAL_DIR:-${RELAX_SLURM_DIR:-/tmp/relax-slurm}}
NODES=${SLURM_NODES:-4}
CPUS=${SLURM_CPUS:-4}
ACCT=${SLURM_ACCOUNTING:-1}
CTLD_PORT=${SLURM_CTLD_PORT:-6917}
DBD_PORT=${SLURM_DBD_PORT:-6919}
DB_PORT=${SLURM_MYSQL_PORT:-13406}
NODE_PORT0=${SLURM_NODE_PORT0:-17101}
WAIT_S=${SLURM_WAIT_S:-60}

export SLURM_CONF=$D/etc/slurm.conf PATH=$PATH:/usr/sbin
log() { echo "[slurm_local $(date +%T.%3N)] $*"; }
die() { echo "[slurm_local] ERROR: $*" >&2; exit 1; }

# alive PIDFILE COMM : true if the pid in PIDFILE is a live (non-zombie) process named COMM
alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null
}

# waitfor SECONDS DESCRIPTION CMD... : poll CMD until it succeeds, or die naming what was waited for
waitfor() {
  local t=$1 what=$2; shift 2
  local end=$(( $(date +%s) + t ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || die "timeout after ${t}s waiting for $what (logs: $D/log)"
    sleep 0.05
  done
}

# stop_pid PIDFILE COMM : SIGTERM the daemon of PIDFILE, SIGKILL after 10 s
stop_pid() {
  local f=$1 c=$2 pid i
  if ! alive "$f" "$c"; then rm -f "$f"; return 0; fi
  pid=$(cat "$f")
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 200); do alive "$f" "$c" || break; sleep 0.05; done
  if alive "$f" "$c"; then log "$c ($pid) ignored SIGTERM for 10s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
  log "stopped $c ($pid)"
  rm -f "$f"
}

cmd_stop() {
  set +e
  # 1. cancel this cluster's jobs, by id, so that no slurmstepd outlives its slurmd
  if alive "$D/run/slurmctld.pid" slurmctld; then
    local ids
    ids=$(timeout 10 squeue -h -o %i 2>/dev/null | sed 's/_.*//' | sort -u | tr '\n' ' ')
    if [ -n "${ids// /}" ]; then
      log "cancelling jobs $ids"
      # shellcheck disable=SC2086
      timeout 10 scancel $ids 2>/dev/null
      for _ in $(seq 1 300); do [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.05; done
    fi
  fi
  # 2. daemons, by PID file
  for f in "$D"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pid "$f" slurmd; done
  stop_pid "$D/run/slurmctld.pid" slurmctld
  stop_pid "$D/run/slurmdbd.pid" slurmdbd
  stop_pid "$D/run/mysqld.pid" mariadbd
  stop_pid "$D/run/munged.pid" munged
  # 3. safety net: step daemons of this cluster (their cwd is $D/log) that survived their slurmd
  for p in /proc/[0-9]*; do
    [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] || continue
    [ "$(readlink "$p/cwd" 2>/dev/null)" = "$D/log" ] || continue
    log "killing leftover slurmstepd ${p#/proc/}"; kill -KILL "${p#/proc/}" 2>/dev/null
  done
  return 0
}

cmd_status() {
  local ok=0 f
  for pair in munged:munged mysqld:mariadbd slurmdbd:slurmdbd slurmctld:slurmctld; do
    f=$D/run/${pair%%:*}.pid
    [ -e "$f" ] || continue
    if alive "$f" "${pair#*:}"; then echo "${pair#*:}: running (pid $(cat "$f"))"; else echo "${pair#*:}: dead"; ok=1; fi
  done
  for f in "$D"/run/slurmd-*.pid; do
    [ -e "$f" ] || continue
    if alive "$f" slurmd; then echo "slurmd $(basename "$f" .pid | sed 's/^slurmd-//'): running (pid $(cat "$f"))"
    else echo "slurmd $(basename "$f" .pid): dead"; ok=1; fi
  done
  if alive "$D/run/slurmctld.pid" slurmctld && [ -f "$SLURM_CONF" ] && timeout 10 sinfo >/dev/null 2>&1; then
    timeout 10 sinfo
    echo "SLURM_CONF=$SLURM_CONF   (source $D/slurm.env)"
  else
    echo "no cluster answering at $D (start it: tools/slurm_local.sh start)"; ok=1
  fi
  return $ok
}

install_packages() {
  local pkgs=(slurmctld slurmd slurm-client munge) bins=(slurmctld slurmd sbatch munged) missing=0 made_policy=0 b
  if [ "$ACCT" = 1 ]; then pkgs+=(slurmdbd mariadb-server); bins+=(slurmdbd mariadbd mariadb-install-db); fi
  for b in "${bins[@]}"; do command -v "$b" >/dev/null || missing=1; done
  [ "$missing" = 1 ] || return 0
  log "installing ${pkgs[*]}"
  if [ ! -e /usr/sbin/policy-rc.d ]; then   # keep apt from starting system-wide services
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1
  fi
  inst() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=120 \
             -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${pkgs[@]}"; }
  local rc=0
  inst >"$D/log/apt.log" 2>&1 || { apt-get update >>"$D/log/apt.log" 2>&1; inst >>"$D/log/apt.log" 2>&1; } || rc=1
  [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ $rc = 0 ] || die "apt-get install failed, see $D/log/apt.log"
  log "installed"
}

write_config() {  # prints 1 when a config file changed
  local mem lastport acct_lines new newdbd newcg changed=0 pair f v
  mem=$(awk '/MemTotal/ {print int($2/1024) - 1024}' /proc/meminfo)   # per node; memory is not consumable (CR_CPU)
  [ "$mem" -gt 1000 ] || mem=1000
  lastport=$(( NODE_PORT0 + NODES - 1 ))
  if [ "$ACCT" = 1 ]; then
    acct_lines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$D/run/munge.socket
JobAcctGatherType=jobacct_gather/linux"
  else
    acct_lines="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
  fi
  local nodeline="NodeName=node[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=$NODE_PORT0-$lastport"
  [ "$NODES" = 1 ] && nodeline="NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$NODE_PORT0"
  new="ClusterName=relaxlocal
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/run/munge.socket,cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
KillWait=5
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmdSpoolDir=$D/spool/%n
StateSaveLocation=$D/state
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2,batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
$acct_lines
JobCompType=jobcomp/filetxt
JobCompLoc=$D/log/jobcomp.txt
$nodeline CPUs=$CPUS RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  newdbd="AuthType=auth/munge
AuthInfo=socket=$D/run/munge.socket
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$D/log/slurmdbd.log
PidFile=$D/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db"
  newcg=$'CgroupPlugin=autodetect\nIgnoreSystemd=yes'
  for pair in "slurm.conf:new" "slurmdbd.conf:newdbd" "cgroup.conf:newcg"; do
    f=$D/etc/${pair%%:*}; v=${pair#*:}
    if [ "$(cat "$f" 2>/dev/null)" != "${!v}" ]; then printf '%s\n' "${!v}" > "$f"; changed=1; fi
  done
  chmod 600 "$D/etc/slurmdbd.conf"
  echo "export SLURM_CONF=$D/etc/slurm.conf" > "$D/slurm.env"
  echo "$changed"
}

nodes_ready() { [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -cE '^(idle|mixed|allocated|completing)$')" -ge "$NODES" ]; }

cmd_start() {
  if [ "${SLURM_RESET:-0}" = 1 ]; then
    log "reset: stopping daemons and wiping state"
    cmd_stop
    rm -rf "$D/state" "$D/spool" "$D/mysql"
  fi
  mkdir -p "$D"/{etc,run,log,state,spool}
  install_packages
  if [ "$(write_config)" = 1 ] && { alive "$D/run/slurmctld.pid" slurmctld || ls "$D"/run/slurmd-*.pid >/dev/null 2>&1; }
  then
    log "config changed while daemons run: restarting"
    cmd_stop
  fi

  # munged: private root-owned key and socket
  if [ ! -s "$D/etc/munge.key" ]; then
    dd if=/dev/urandom of="$D/etc/munge.key" bs=1024 count=1 2>/dev/null; chmod 600 "$D/etc/munge.key"
  fi
  if ! alive "$D/run/munged.pid" munged; then
    log "starting munged"
    munged --key-file="$D/etc/munge.key" --socket="$D/run/munge.socket" --pid-file="$D/run/munged.pid" \
           --log-file="$D/log/munged.log" --seed-file="$D/run/munged.seed"
  fi
  waitfor 10 munged bash -c "munge -S '$D/run/munge.socket' -n | unmunge -S '$D/run/munge.socket'"

  if [ "$ACCT" = 1 ]; then
    if [ ! -d "$D/mysql/mysql" ]; then
      log "initialising the mariadb datadir"
      mariadb-install-db --no-defaults --datadir="$D/mysql" --user=root --auth-root-authentication-method=normal \
        --skip-test-db >"$D/log/mysql-install.log" 2>&1 || die "mariadb-install-db failed, see $D/log/mysql-install.log"
    fi
    if ! alive "$D/run/mysqld.pid" mariadbd; then
      log "starting mariadbd"
      setsid mariadbd --no-defaults --datadir="$D/mysql" --socket="$D/run/mysqld.sock" --port="$DB_PORT" \
        --bind-address=127.0.0.1 --skip-name-resolve --user=root --pid-file="$D/run/mysqld.pid" \
        --log-error="$D/log/mysqld.log" --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
        </dev/null >/dev/null 2>&1 &
    fi
    waitfor "$WAIT_S" mariadbd mariadb --no-defaults -S "$D/run/mysqld.sock" -uroot -e 'select 1'
    mariadb --no-defaults -S "$D/run/mysqld.sock" -uroot -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
      CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
    if ! alive "$D/run/slurmdbd.pid" slurmdbd; then
      log "starting slurmdbd"
      slurmdbd   # reads slurmdbd.conf beside $SLURM_CONF
    fi
    waitfor "$WAIT_S" slurmdbd sacctmgr -n -Q list cluster
  fi

  if ! alive "$D/run/slurmctld.pid" slurmctld; then
    log "starting slurmctld"
    slurmctld -i
  fi
  waitfor "$WAIT_S" slurmctld bash -c 'scontrol ping | grep -q UP'
  local i n
  for i in $(seq 1 "$NODES"); do
    n=node$i
    mkdir -p "$D/spool/$n"
    alive "$D/run/slurmd-$n.pid" slurmd || slurmd -N "$n"
  done
  log "slurmd running for node1..node$NODES"

  local end=$(( $(date +%s) + WAIT_S )) resumed=0
  until nodes_ready; do
    if [ $resumed = 0 ] && sinfo -h -N -o '%T' 2>/dev/null | grep -qE 'down|drain'; then
      scontrol update nodename="node[1-$NODES]" state=resume >/dev/null 2>&1 || true; resumed=1   # from an old run
    fi
    [ "$(date +%s)" -lt "$end" ] || { sinfo -N -l >&2; die "nodes not idle after ${WAIT_S}s (logs: $D/log)"; }
    sleep 0.05
  done
  sinfo
  log "ready; use:  source $D/slurm.env"
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$D/etc/slurm.conf" ;;
  *) echo "usage: $0 start|stop|status|env   (state under \$SLURM_LOCAL_DIR, default /tmp/relax-slurm)" >&2; exit 2 ;;
esac
