"""Several hosts on one Linux machine: network namespaces joined by a bridge, and MPI or torchrun jobs across them.

The MPI tier's tests on one machine prove little about the network: MPICH (and UCX underneath it)
moves data between processes of one machine through shared memory, and network namespaces share
``/dev/shm``. :class:`Hosts` makes N emulated hosts, each a network namespace with one interface
(``hnet0``, a veth) into a bridge that lives in a namespace of its own, so that nothing is added
to the machine's own network: no interface, no address, no route outside the namespaces made here.
:func:`transport_env` forces MPICH's netmod onto TCP over that interface, and :class:`Job` runs an
``mpiexec`` across the hosts the way a cluster without ssh does (hydra's ``-launcher manual``: the
launcher in host 0, one ``hydra_pmi_proxy`` started in each host's namespace) or one with ssh
(hydra's ssh launcher through :meth:`Hosts.ssh`), so the launcher, the proxies and the ranks talk
only through the bridge, and cutting a host's link (:meth:`Hosts.set_link`) cuts that host off from
all of them. :class:`TorchrunJob` runs one torchrun agent per host instead (the gloo tier).

Invariants: everything this module creates is named with one prefix unique to the process
(``cgdp<pid>n<k>``); :meth:`Hosts.close` (also on errors, and from ``with``) kills the processes left
inside those namespaces, by pid, and deletes the namespaces, which removes their interfaces (and
the ssh stand-in's temporary directory).

Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) and iproute2's ``ip``; :func:`unavailable` says
why not where it cannot run. May import: nothing of cgdp (it starts processes that do).
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

IFACE = "hnet0"
SUBNET = "10.231.0"
"""Addresses ``10.231.0.1 ...`` exist only inside the namespaces (isolated: no clash is possible)."""
_count = itertools.count()


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's ip command is missing (apt-get install iproute2)"
    name = f"cgdp{os.getpid()}probe{next(_count)}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode != 0:
        return f"ip netns add failed here ({p.stderr.strip()}): no CAP_SYS_ADMIN in this container?"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str) -> str:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {p.stderr.strip()}")
    return p.stdout


class Hosts:
    """``n`` emulated hosts (network namespaces) on one bridge; a context manager.

    Host ``i`` is namespace ``names[i]`` with ``lo`` and ``hnet0`` (address ``addresses[i]``/24);
    the bridge is in namespace ``switch``.
    """

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"need at least one host, got {n}")
        prefix = f"cgdp{os.getpid()}n{next(_count)}"
        self.switch = f"{prefix}sw"
        self.names = [f"{prefix}h{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self._made: list[str] = []
        self._tmp: str | None = None
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        for ns in (self.switch, *self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addresses)):
            # both ends are created inside namespaces: nothing appears in the machine's own
            _ip("link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", f"p{i}",
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` as run inside host ``i``."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def set_link(self, i: int, up: bool) -> None:
        """Bring host ``i``'s interface up or down (down: the host is cut off, as by a pulled cable)."""
        _ip("-n", self.names[i], "link", "set", IFACE, "up" if up else "down")

    def bytes(self, i: int) -> tuple[int, int]:
        """(received, sent) bytes counted by the kernel on host ``i``'s interface."""
        link = json.loads(_ip("-n", self.names[i], "-j", "-s", "link", "show", IFACE))[0]
        stats = link["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def ssh(self) -> str:
        """A stand-in for ``ssh``: ``SSH [-x] ADDRESS COMMAND...`` runs COMMAND with ``sh`` inside the
        host that has ADDRESS, as sshd would on that machine: in a fresh environment (``PATH`` and
        ``HOME`` only), so what a rank sees comes from ``mpiexec`` (for ``mpiexec -launcher-exec``)."""
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="cgdp-netns-")
            cases = "".join(f"  {a}) ns={n};;\n" for a, n in zip(self.addresses, self.names))
            with open(os.path.join(self._tmp, "ssh"), "w") as f:
                f.write(f'#!/bin/sh\n[ "$1" = -x ] && shift\nhost=$1; shift\ncase $host in\n{cases}'
                        f'  *) echo "no host $host" >&2; exit 255;;\nesac\n'
                        f'exec ip netns exec $ns env -i PATH="$PATH" HOME="$HOME" sh -c "$*"\n')
            os.chmod(os.path.join(self._tmp, "ssh"), 0o755)
        return os.path.join(self._tmp, "ssh")

    def pids(self, i: int) -> list[int]:
        """The processes running inside host ``i``."""
        out = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def processes(self) -> dict[int, str]:
        """Every live process inside the hosts: pid -> ``host<i>:<command name>``."""
        out = {}
        for i in range(len(self.names)):
            for pid in self.pids(i):
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        out[pid] = f"host{i}:{f.read().strip()}"
                except FileNotFoundError:
                    pass
        return out

    def close(self) -> None:
        for ns in reversed(self._made):
            if ns != self.switch:
                for pid in self.pids(self.names.index(ns)):
                    _kill(pid)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


TRANSPORT_VARS = ("MPIR_CVAR_CH4_NETMOD", "UCX_TLS", "UCX_NET_DEVICES", "FI_PROVIDER", "FI_TCP_IFACE")


def job_env(netmod: str | None, pythonpath: list[str]) -> dict[str, str]:
    """This process's environment for a job: one thread per library (2-core CI), ``pythonpath``
    first, and the transport forced onto TCP over the hosts' links (``netmod`` None: the
    library's own choice, which on one machine is shared memory)."""
    env = {k: v for k, v in os.environ.items() if k not in TRANSPORT_VARS}
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")]))
    if netmod is not None:
        env.update(transport_env(netmod))
    return env


def transport_env(netmod: str, iface: str = IFACE) -> dict[str, str]:
    """Environment forcing the mpich wheel's netmod ``"ucx"`` or ``"ofi"`` onto TCP over ``iface``.

    UCX would otherwise pick shared memory between processes that share ``/dev/shm`` (and ignore
    ``MPIR_CVAR_NOLOCAL``); ``self`` is needed for a rank's messages to itself.
    """
    if netmod == "ucx":
        return {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": iface}
    if netmod == "ofi":
        return {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": iface}
    raise ValueError(f"netmod must be 'ucx' or 'ofi', got {netmod!r}")


@dataclass
class Job:
    """``mpiexec`` in host 0, one ``hydra_pmi_proxy`` and one rank per host of ``rank_hosts``.

    ``launcher="manual"`` (hydra prints one proxy command per host; this starts each inside its
    host, as a site without ssh would) or ``"ssh"`` (hydra starts them itself through
    :meth:`Hosts.ssh`, as over ssh on a cluster). ``lines`` collects the job's output (every rank's stdout and stderr, as forwarded by hydra) with
    the monotonic time each line arrived. Use :meth:`wait`; :meth:`kill` ends what is left.
    """
    hosts: Hosts
    argv: list[str]
    env: dict[str, str]
    rank_hosts: list[int] | None = None
    """The hosts that run a rank (default: all); mpiexec runs in host 0 either way."""
    launcher: str = "manual"
    lines: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        on = list(range(len(self.hosts.names))) if self.rank_hosts is None else list(self.rank_hosts)
        if self.launcher not in ("manual", "ssh"):
            raise ValueError(f"launcher must be 'manual' or 'ssh', got {self.launcher!r}")
        how = ["-launcher", "manual"] if self.launcher == "manual" else ["-launcher-exec", self.hosts.ssh()]
        cmd = ["mpiexec", *how, "-iface", IFACE, "-n", str(len(on)), "-ppn", "1",
               "-hosts", ",".join(self.hosts.addresses[i] for i in on), *self.argv]
        self.mpiexec = subprocess.Popen(self.hosts.run(0, cmd), env=self.env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.proxies: list[subprocess.Popen] = []
        if self.launcher == "manual":
            try:
                self._start_proxies(on)
            except BaseException:
                self.kill()
                raise
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _start_proxies(self, on: list[int]) -> None:
        """Start the proxy commands hydra prints (one per host, then an end mark) in their hosts."""
        launch = []
        assert self.mpiexec.stdout is not None
        for line in self.mpiexec.stdout:
            if line.startswith("HYDRA_LAUNCH: "):
                launch.append(line.split(": ", 1)[1].split())
            elif line.startswith("HYDRA_LAUNCH_END"):
                break
            else:
                self.lines.append((time.monotonic(), line))
        if len(launch) != len(on):
            raise RuntimeError(f"mpiexec gave {len(launch)} proxy commands for {len(on)} hosts: "
                               + "".join(s for _, s in self.lines))
        for i, argv in zip(on, launch):
            self.proxies.append(subprocess.Popen(self.hosts.run(i, argv), env=self.env, stdin=subprocess.DEVNULL,
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def _read(self) -> None:
        assert self.mpiexec.stdout is not None
        for line in self.mpiexec.stdout:
            self.lines.append((time.monotonic(), line))

    @property
    def output(self) -> str:
        return "".join(s for _, s in self.lines)

    def wait_for(self, text: str, timeout: float) -> float:
        """Wait until a line holding ``text`` arrives; its arrival time (TimeoutError if it never does)."""
        end = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < end:
            for t, line in self.lines[seen:]:
                if text in line:
                    return t
            seen = len(self.lines)
            if self.mpiexec.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise TimeoutError(f"no line with {text!r} within {timeout:g} s; output:\n{self.output}")

    def processes(self) -> dict[int, str]:
        """Every live process of the job: pid -> ``host<i>:<command name>``."""
        return self.hosts.processes()

    def wait(self, timeout: float) -> int:
        """mpiexec's exit code; kills the job and raises TimeoutError if it runs past ``timeout``."""
        try:
            rc = self.mpiexec.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"the MPI job ran past {timeout:g} s; output:\n{self.output}") from None
        for p in self.proxies:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        """SIGKILL every process of the job (mpiexec ignores SIGTERM while it waits for its proxies)."""
        for p in [self.mpiexec, *self.proxies]:
            if p.poll() is None:
                _kill(p.pid)
        for pid in self.processes():
            _kill(pid)
        for p in [self.mpiexec, *self.proxies]:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


class TorchrunJob:
    """``torchrun --nnodes N --nproc-per-node 1 --node-rank i`` in each host ``i``: the rendezvous
    (torchrun's static one, its store in host 0's agent) at host 0's address, gloo on ``hnet0``
    (``GLOO_SOCKET_IFNAME``; the namespaces' hostname resolves to no address inside them).
    ``lines`` collects every agent's output (its worker's stdout and stderr), each line prefixed
    ``h<i>: ``, with its arrival time. Use :meth:`wait`; :meth:`kill` ends what is left."""

    def __init__(self, hosts: Hosts, argv: list[str], env: dict[str, str], port: int = 29400):
        self.hosts = hosts
        self.lines: list[tuple[float, str]] = []
        env = dict(env, GLOO_SOCKET_IFNAME=IFACE)
        n = len(hosts.names)
        self.agents = []
        for i in range(n):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--nproc-per-node", "1",
                   "--node-rank", str(i), "--master-addr", hosts.addresses[0], "--master-port", str(port),
                   "--max-restarts", "0", *argv]
            self.agents.append(subprocess.Popen(hosts.run(i, cmd), env=env, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        self._readers = [threading.Thread(target=self._read, args=(i, a), daemon=True)
                         for i, a in enumerate(self.agents)]
        for t in self._readers:
            t.start()

    def _read(self, i: int, agent: subprocess.Popen) -> None:
        assert agent.stdout is not None
        for line in agent.stdout:
            self.lines.append((time.monotonic(), f"h{i}: {line}"))

    @property
    def output(self) -> str:
        return "".join(s for _, s in self.lines)

    def wait_for(self, text: str, timeout: float) -> float:
        """Wait until a line holding ``text`` arrives; its arrival time (TimeoutError if it never does)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for t, line in list(self.lines):
                if text in line:
                    return t
            if all(a.poll() is not None for a in self.agents):
                break
            time.sleep(0.05)
        raise TimeoutError(f"no line with {text!r} within {timeout:g} s; output:\n{self.output}")

    def wait(self, timeout: float) -> list[int]:
        """Every agent's exit code; kills the job and raises TimeoutError past ``timeout``."""
        end = time.monotonic() + timeout
        try:
            codes = [a.wait(max(0.1, end - time.monotonic())) for a in self.agents]
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"the torchrun job ran past {timeout:g} s; output:\n{self.output}") from None
        for t in self._readers:
            t.join(5)
        return codes

    def kill(self) -> None:
        for a in self.agents:
            if a.poll() is None:
                _kill(a.pid)
        for pid in self.hosts.processes():
            _kill(pid)
        for a in self.agents:
            try:
                a.wait(5)
            except subprocess.TimeoutExpired:
                pass


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped by its parent, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def end_times(pids: dict[int, str], since: float, limit: float, poll_s: float = 0.02) -> dict[str, float | None]:
    """Seconds from ``since`` (monotonic) until each process ended; None for those still alive
    ``limit`` seconds after ``since``."""
    left = dict(pids)
    ended: dict[str, float | None] = {}
    while left and time.monotonic() - since < limit:
        for pid in list(left):
            if not alive(pid):
                ended[f"{left.pop(pid)}[{pid}]"] = time.monotonic() - since
        time.sleep(poll_s)
    ended.update({f"{name}[{pid}]": None for pid, name in left.items()})
    return ended


def cut_during_training(hosts: Hosts, env: dict[str, str], out: str | os.PathLike, timeout_s: float,
                        steps_before: int = 3, limit: float = 90.0) -> tuple[dict[str, float | None], str]:
    """``python -m cgdp.train --out OUT`` across ``hosts``; once rank 0 has logged ``steps_before``
    steps, host 1's link goes down. Returns the seconds from the cut until each process of the
    job ended (None: still alive ``limit`` seconds after the cut) and the job's output. The test
    of the bound (tests/test_multihost.py) and its measurement (bench/bench_cut_link.py) run this."""
    argv = [sys.executable, "-m", "cgdp.train", "--steps", "100000", "--devices", "1", "--batch", "8",
            "--chunks", "1", "--profile_every", "0", "--timeout_s", f"{timeout_s:g}", "--out", os.fspath(out),
            "--progress", "off", "--plots", "false"]
    metrics = os.path.join(out, "metrics.jsonl")
    job = Job(hosts, argv, env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with open(metrics) as f:
                    if f.read().count('"kind": "step"') >= steps_before:
                        break
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline or job.mpiexec.poll() is not None:
                raise RuntimeError(f"the training job did not start; its output:\n{job.output}")
            time.sleep(0.05)
        procs = job.processes()
        t_cut = time.monotonic()
        hosts.set_link(1, up=False)
        ended = end_times(procs, t_cut, limit)
    finally:
        job.kill()
    return ended, job.output
