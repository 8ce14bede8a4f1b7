"""A real single-node Slurm (munge + slurmctld + slurmd) on localhost, for tests.

Follows /work/shared/notes/slurm-in-ci.md: Debian's slurm-wlm and munge, no systemd, root.
Everything Slurm writes lives under one temporary directory; clients find the cluster
through SLURM_CONF in `self.env`.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "squeue", "scancel", "mungekey")
INSTALL_HINT = ("apt-get update && apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge "
                "(as root; .ci/run does this)")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
SBIN = ("/usr/sbin", "/sbin")


def which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def missing_binaries() -> list[str]:
    return [name for name in DAEMONS + CLIENTS if which(name) is None]


def wait_for(what: str, check, timeout: float, interval: float = 0.2):
    """Poll `check()` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _run(args: list[str], env=None, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, check=check, capture_output=True, text=True, timeout=60, cwd=cwd)


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.env["PATH"] = os.pathsep.join([self.env.get("PATH", ""), *SBIN])
        self._pids: list[int] = []

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> LocalSlurm:
        self._start_munge()
        for sub in ("state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._slurm_conf())
        _run([which("slurmctld"), "-f", str(self.conf)], env=self.env)
        self._pids.append(self._pid_from("slurmctld"))
        _run([which("slurmd"), "-f", str(self.conf), "-N", "localhost"], env=self.env)
        self._pids.append(self._pid_from("slurmd"))
        wait_for("the node to be idle (see " + str(self.root / "log") + ")",
                 lambda: _run(["sinfo", "-h", "-n", "localhost", "-o", "%T"], self.env, check=False)
                 .stdout.strip() == "idle", timeout=60)
        return self

    def stop(self) -> None:
        _run(["scancel", "--full", "--user", str(os.getuid())], self.env, check=False)
        try:  # let slurmd end the jobs' processes before it goes
            wait_for("jobs to end", lambda: not _run(["squeue", "-h"], self.env, check=False).stdout.strip(), 60)
        except TimeoutError:
            pass
        for pid in reversed(self._pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in self._pids:
            try:
                wait_for(f"pid {pid} to exit", lambda: not _alive(pid), timeout=20)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
        self._pids.clear()

    def _start_munge(self) -> None:
        if MUNGE_SOCKET.exists() and _run(["pgrep", "-x", "munged"], check=False).returncode == 0:
            return  # a munged is already serving this machine
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            _run([which("mungekey"), "-c"])
            shutil.chown(key, "munge", "munge")
            key.chmod(0o600)
        _run(["install", "-d", "-o", "munge", "-g", "munge", str(MUNGE_SOCKET.parent)])
        _run(["runuser", "-u", "munge", "--", which("munged")])
        wait_for("munged's socket", MUNGE_SOCKET.exists, timeout=30)
        pidfile = Path("/run/munge/munged.pid")
        if pidfile.exists():
            self._pids.insert(0, int(pidfile.read_text().split()[0]))

    def _pid_from(self, daemon: str) -> int:
        pidfile = self.root / "run" / f"{daemon}.pid"
        return int(wait_for(f"{pidfile}", lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=30))

    def _slurm_conf(self) -> str:
        hw = _run([which("slurmd"), "-C"]).stdout.splitlines()[0].split()
        hw = " ".join(f for f in hw if not f.startswith(("NodeName=", "UpTime=")))
        r = self.root
        return f"""\
ClusterName=sonic-ci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=300
KillWait=10
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
NodeName=localhost NodeAddr=127.0.0.1 {hw}
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""

    # --- jobs ----------------------------------------------------------------------------
    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit from `cwd` (the job's SLURM_SUBMIT_DIR); return the job id."""
        out = _run(["sbatch", "--parsable", *args], {**self.env, **(env or {})}, cwd=cwd)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict ({} once the record is gone)."""
        out = _run(["scontrol", "show", "job", "-o", job_id], self.env, check=False).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        return wait_for(f"job {job_id} to reach {'/'.join(states)}",
                        lambda: (j := self.job(job_id)).get("JobState") in states and j, timeout, interval=0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
