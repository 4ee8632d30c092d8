"""A real single-node Slurm on 127.0.0.1 for tests: munged, slurmctld and slurmd in a temp dir.

Used by the ``slurm_cluster`` and ``slurm_two_nodes`` fixtures (fixtures.py); also runnable by hand::

    python tests/support/local_slurm.py  # prints 'export SLURM_CONF=...', Ctrl-C stops it

Everything (config, keys, sockets, state, spool, logs) lives in one temporary directory. The three
daemons run in the foreground as children of this process, so :meth:`LocalSlurm.stop` stops them
by PID and reaps them; nothing is left running.

Configuration facts this rests on (Slurm 22.05, Debian 12): ``batch_sched_delay=0`` and
``sched_min_interval=0`` make jobs start at once; ``EnforcePartLimits=ALL`` rejects an oversized
job instead of leaving it pending forever; ``SlurmdParameters=config_overrides`` lets the node
claim more CPUs than it has, and ``OverSubscribe=FORCE:4`` lets co-located jobs share cores;
proctrack/linuxproc and task/none need no cgroups; the spool directory is fixed (``%n`` in it is
not created).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What a batch step spanning the two local "nodes" of ``LocalSlurm(nodes=2)`` exports before srun.
# Two faults of the PyPI MPICH wheel's default UCX netmod show there, both outside hpcstagger:
# - UCX's shared-memory transports trip over each other between two "nodes" on one host;
# - MPICH publishes its UCX address at start-up through PMI-1 "put" lines that, run-length
#   encoded, sometimes exceed the 1024 bytes a line that Slurm 22.05's pmi2 plugin reads, and the
#   step then dies in MPI_Init ("mpi/pmi2: value not properly terminated in client request").
#   How long a line is depends on the address bytes, so it fails now and then, not always.
# MPICH's OFI netmod over TCP has a short address and neither fault. See README, Troubleshooting.
MULTI_NODE_MPI_ENV = "export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp"

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun", "scancel")


def missing_binaries() -> list[str]:
    """Names of the Slurm/munge commands that are not on PATH (sbin included)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """Start and stop a local Slurm cluster; ``env`` is what a client needs (SLURM_CONF, PATH).

    With ``nodes=1`` (the default) the one node is this host under its own name. With ``nodes=N``
    there are N slurmd daemons on this host, nodes ``n1`` .. ``nN`` on their own ports, each with
    ``cpus`` CPUs: Slurm sees N nodes, which heterogeneous jobs need (Slurm 22.05's backfill
    scheduler never places two components of one heterogeneous job on the same node).
    """

    def __init__(self, cpus: int = 8, partition: str = "debug", base: str | None = None,
                 extra_conf: str = "", nodes: int = 1):
        self.cpus = cpus
        self.extra_conf = extra_conf
        # MPICH names its /dev/shm segment after the PMI key-value space, which under srun is
        # "<job id>.<step id>": a fresh cluster reusing job ids would collide with a segment that
        # an aborted job of an earlier cluster left behind.
        self.first_job_id = int.from_bytes(os.urandom(3), "little") + 1000
        self.partition = partition
        self.base = base
        self.dir = Path(tempfile.mkdtemp(prefix="hpcstagger-slurm-", dir=base))
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [self.host] if nodes == 1 else [f"n{i}" for i in range(1, nodes + 1)]
        self.node = self.nodes[0]
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}

    # ------------------------------------------------------------------ config
    def _write_config(self) -> Path:
        d = self.dir
        d.chmod(0o755)  # munged needs every directory above its socket searchable
        for sub, mode in (("munge", 0o700), ("run", 0o755), ("state", 0o700), ("spool", 0o755),
                          ("log", 0o755), ("jobs", 0o777)):
            (d / sub).mkdir()
            (d / sub).chmod(mode)
        for node in self.nodes:  # slurmd does not create a %n spool directory itself
            (d / "spool" / node).mkdir()
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        conf = d / "slurm.conf"
        conf.write_text(f"""\
ClusterName=hpcstagger-test
FirstJobId={self.first_job_id}
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={d}/run/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=3600
KillWait=5
{self._node_lines()}
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
{self.extra_conf}""")
        return conf

    def _node_lines(self) -> str:
        if self.nodes == [self.host]:
            return f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN"
        return "\n".join(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={_free_port()} "
                         f"CPUs={self.cpus} State=UNKNOWN" for n in self.nodes)

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.dir / "log" / f"{name}.stdout", "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def _log_tail(self, lines: int = 15) -> str:
        parts = []
        for f in sorted((self.dir / "log").glob("*")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            if text:
                parts.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def start(self, timeout: float = 30.0, attempts: int = 3) -> LocalSlurm:
        """Write the config, start the daemons, and wait until the node is idle. The ports are
        picked free but not held, so another cluster starting at the same moment (tests in
        parallel) can take one first: a daemon that then fails to bind is retried on fresh ports."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(timeout)
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == attempts:
                    raise
                self.procs = {}
                self.dir = Path(tempfile.mkdtemp(prefix="hpcstagger-slurm-", dir=self.base))
        raise AssertionError("not reached")

    def _start_once(self, timeout: float) -> LocalSlurm:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"Slurm commands missing: {', '.join(missing)}; on Debian: "
                               "apt-get install slurmctld slurmd slurm-client munge")
        conf = self._write_config()
        d = self.dir
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
        self.env = {**os.environ, "SLURM_CONF": str(conf), "PATH": path}
        self.env.pop("MPIR_CVAR_PMI_VERSION", None)
        self._spawn("munged", ["munged", "-F", f"--socket={d}/run/munge.sock",
                               f"--key-file={d}/munge/munge.key", f"--pid-file={d}/run/munged.pid",
                               f"--log-file={d}/log/munged.log", f"--seed-file={d}/munge/seed"])
        self._wait_for(lambda: (d / "run" / "munge.sock").exists(), 10, "munged to create its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i"])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
        self._wait_for(self._node_idle, timeout, f"node(s) {','.join(self.nodes)} to become idle")
        return self

    def _node_idle(self) -> bool:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True,
                              env=self.env, timeout=10)
        states = proc.stdout.split()
        return proc.returncode == 0 and len(states) == len(self.nodes) and set(states) == {"idle"}

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                log = self._log_tail()
                self.stop()
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n{log}")
            if ready():
                return
            time.sleep(0.1)
        log = self._log_tail()
        self.stop()
        raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}:\n{log}")

    def stop(self, keep_dir: bool = False) -> None:
        """Cancel every job, stop slurmd, slurmctld and munged by PID, reap them, remove the dir."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=self.env,
                           capture_output=True, timeout=15)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                q = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True,
                                   text=True, timeout=10)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.2)
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    cluster = LocalSlurm().start()
    print(f"export SLURM_CONF={cluster.env['SLURM_CONF']}")
    print("local Slurm running; Ctrl-C stops it", file=sys.stderr)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
