"""Real separate "hosts" on one Linux machine, for multi-host tests (network namespaces).

Each host is a network namespace joined to a bridge in the root namespace by a
veth pair, with its own host name (a UTS namespace) and its own ``/dev/shm``
(a private tmpfs in a mount namespace), so shared memory between hosts is
impossible and TCP really crosses interfaces. Its links are shaped with
``tc qdisc ... tbf``. The scheduler runs in the root namespace on the bridge
address; the Dask workers of host ``i`` run inside its namespaces, with the
test's Python and ``PYTHONPATH``.

Everything this module makes is named ``ddt<tag>...`` (namespaces
``ddt<tag>-h<i>``, bridge ``ddt<tag>b``, veths ``ddt<tag>v<i>``) on a private
subnet ``10.77.<n>.0/24`` that no other interface uses, and recorded in a state
file under ``$TMPDIR/daskdist-netns/``. ``close()`` removes it all (the
fixture calls it, also on failure and on SIGTERM); what a killed run left
behind (its owner process is gone) is removed by ``remove_stale()``, which
``start_hosts`` calls first. Every child process also gets SIGKILL when the
test process dies (``setpriv --pdeathsig``).

Recipe: ``reference/strategies.md`` section 6.2.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from daskdist.cluster.identity import scheduler_workers

__all__ = ["NetnsHost", "NetnsHosts", "remove_stale", "start_hosts", "unavailable_reason"]

STATE_DIR = Path(tempfile.gettempdir()) / "daskdist-netns"
PREFIX = "ddt"
TOOLS = ("ip", "tc", "unshare", "nsenter", "setpriv")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespace hosts cannot be made here (``None`` when they can)."""
    if sys.platform != "linux":
        return "network namespace hosts need Linux"
    if os.geteuid() != 0:
        return "network namespace hosts need root (ip netns, veth, bridge, unshare)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"network namespace hosts need {', '.join(missing)} (iproute2 / util-linux; make test installs iproute2)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


#: Prefix of every child's command: SIGKILL it when the test process dies (Linux ``PR_SET_PDEATHSIG``,
#: kept across the ``exec`` of ``ip netns exec``, ``unshare`` and ``nsenter``, which do not fork).
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL", "--"]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class NetnsHost:
    """One simulated host: its namespace, root-side veth, address, host name and worker processes."""

    index: int
    namespace: str
    veth: str
    address: str
    hostname: str
    anchor: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)

    @property
    def worker_names(self) -> list[str]:
        return [f"{self.hostname}-{k}" for k in range(len(self.workers))]


@dataclass
class NetnsHosts:
    """Hosts on a bridge, a scheduler on the bridge address, and how to take it all down again."""

    tag: str
    subnet: int
    bridge: str
    hosts: list[NetnsHost]
    scheduler: subprocess.Popen | None = None
    scheduler_address: str = ""
    rate: str = "10gbit"
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="daskdist-netns-logs-")))
    tls_files: dict[str, str] | None = None  # ``tls=True``: the PEM files of the cluster's one key and certificate

    def security(self):
        """The client's ``distributed.Security`` for this cluster (``None`` without TLS)."""
        if self.tls_files is None:
            return None
        from distributed.security import Security

        return Security(tls_ca_file=self.tls_files["ca"], tls_client_cert=self.tls_files["cert"],
                        tls_client_key=self.tls_files["key"], require_encryption=True)

    def tls_arguments(self) -> list[str]:
        """The TLS options of ``dask scheduler`` and ``dask worker`` (none without TLS)."""
        if self.tls_files is None:
            return []
        files = self.tls_files
        return ["--tls-ca-file", files["ca"], "--tls-cert", files["cert"], "--tls-key", files["key"]]

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{self.tag}.json"

    @property
    def bridge_address(self) -> str:
        return f"10.77.{self.subnet}.1"

    def link_down(self, index: int) -> None:
        """Cut host ``index`` off (its veth goes down: no FIN, no RST, packets just vanish)."""
        _run("ip", "link", "set", self.hosts[index].veth, "down")

    def link_up(self, index: int) -> None:
        """Reconnect host ``index``; neighbour entries that failed during the outage are forgotten."""
        _run("ip", "link", "set", self.hosts[index].veth, "up")
        for host in self.hosts:
            _run("ip", "-n", host.namespace, "neigh", "flush", "all", check=False)
        _run("ip", "neigh", "flush", "dev", self.bridge, check=False)

    def shape(self, rate: str) -> None:
        """Limit every host's outgoing link to ``rate`` (``10gbit``, ``1gbit``) with a token bucket."""
        for host in self.hosts:
            _run("ip", "netns", "exec", host.namespace, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                 "rate", rate, "burst", "1mb", "latency", "50ms")
        self.rate = rate

    def close(self) -> None:
        """Stop every process and remove the namespaces, links and bridge (idempotent)."""
        procs = [w for h in self.hosts for w in h.workers] + [h.anchor for h in self.hosts if h.anchor]
        if self.scheduler is not None:
            procs.append(self.scheduler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        _remove(self.tag, [h.namespace for h in self.hosts], [h.veth for h in self.hosts], self.bridge)
        self.state_file.unlink(missing_ok=True)
        shutil.rmtree(self.log_dir, ignore_errors=True)  # the processes' logs and the TLS key (were left in /tmp)


def _remove(tag: str, namespaces: list[str], veths: list[str], bridge: str) -> None:
    """Kill what still runs in ``namespaces`` and delete them, their veths and the bridge."""
    for ns in namespaces:
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for veth in veths:
        _run("ip", "link", "del", veth, check=False)  # deletes the peer (eth0 inside) too
    for ns in namespaces:
        _run("ip", "netns", "del", ns, check=False)
    _run("ip", "link", "del", bridge, check=False)


def remove_stale() -> list[str]:
    """Remove what earlier runs left behind when their process was killed; returns their tags."""
    removed = []
    for path in STATE_DIR.glob("*.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(int(state.get("pid", 0))):
            continue
        for pid in state.get("pids", []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _remove(state["tag"], state["namespaces"], state["veths"], state["bridge"])
        if state.get("log_dir"):
            shutil.rmtree(state["log_dir"], ignore_errors=True)
        path.unlink(missing_ok=True)
        removed.append(state["tag"])
    return removed


def _free_subnet() -> int:
    """A ``10.77.<n>.0/24`` subnet no interface of this machine uses."""
    used = _run("ip", "-o", "-4", "addr", "show").stdout
    start = os.getpid() % 200 + 20
    for offset in range(200):
        n = (start + offset) % 230 + 20
        if f" 10.77.{n}." not in used:
            return n
    raise RuntimeError("no free 10.77.x.0/24 subnet for namespace hosts")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _environment() -> dict[str, str]:
    """The test's environment, with this checkout first on ``PYTHONPATH`` (workers import the same daskdist)."""
    env = dict(os.environ)
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def start_hosts(n_hosts: int = 2, workers_per_host: int | list[int] = 2, rate: str = "10gbit",
                timeout: float = 60, tls: bool = False) -> NetnsHosts:
    """Make ``n_hosts`` namespace hosts, a scheduler on the bridge, and the Dask workers on each host.

    Workers are named ``h<i>-<k>`` (so the placement order is host by host)
    and single-threaded, without a nanny (a kill -9 kills the worker for good).
    ``tls``: the cluster speaks ``tls://`` with a temporary self-signed
    certificate (``Security.temporary``, written to the log directory; needs
    ``cryptography``), so replicas talk over TLS too; the client connects
    with ``NetnsHosts.security()``.
    On any failure everything made so far is removed before the error is raised.
    """
    remove_stale()
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    per_host = [workers_per_host] * n_hosts if isinstance(workers_per_host, int) else list(workers_per_host)
    tag = secrets.token_hex(3)[:5]
    subnet = _free_subnet()
    hosts = [NetnsHost(i, f"{PREFIX}{tag}-h{i + 1}", f"{PREFIX}{tag}v{i + 1}", f"10.77.{subnet}.{11 + i}",
                       f"h{i + 1}") for i in range(n_hosts)]
    cluster = NetnsHosts(tag, subnet, f"{PREFIX}{tag}b", hosts, rate=rate)
    cluster.state_file.write_text(json.dumps({
        "tag": tag, "pid": os.getpid(), "namespaces": [h.namespace for h in hosts],
        "veths": [h.veth for h in hosts], "bridge": cluster.bridge, "pids": [], "log_dir": str(cluster.log_dir)}))
    try:
        if tls:
            _write_tls_files(cluster)
        _make_network(cluster)
        cluster.shape(rate)
        _start_processes(cluster, per_host, timeout)
    except BaseException:
        cluster.close()
        raise
    return cluster


def _write_tls_files(cluster: NetnsHosts) -> None:
    from distributed.security import Security

    temporary = Security.temporary()
    files = {}
    for name, contents in (("ca", temporary.tls_ca_file), ("cert", temporary.tls_scheduler_cert),
                           ("key", temporary.tls_scheduler_key)):
        path = cluster.log_dir / f"tls-{name}.pem"
        path.write_text(contents)
        path.chmod(0o600)
        files[name] = str(path)
    cluster.tls_files = files


def _make_network(cluster: NetnsHosts) -> None:
    bridge = cluster.bridge
    _run("ip", "link", "add", bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{cluster.bridge_address}/24", "dev", bridge)
    _run("ip", "link", "set", bridge, "up")
    for host in cluster.hosts:
        ns, peer = host.namespace, f"{PREFIX}{cluster.tag}p{host.index + 1}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer, "netns", ns)
        _run("ip", "link", "set", host.veth, "master", bridge, "up")
        _run("ip", "-n", ns, "link", "set", peer, "name", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")


def _start_processes(cluster: NetnsHosts, per_host: list[int], timeout: float) -> None:
    env = _environment()
    port = _free_port(cluster.bridge_address)
    scheme = "tcp" if cluster.tls_files is None else "tls"
    cluster.scheduler_address = f"{scheme}://{cluster.bridge_address}:{port}"
    log = open(cluster.log_dir / "scheduler.log", "wb")  # noqa: SIM115  (closed with the process)
    cluster.scheduler = subprocess.Popen(
        [*DIE_WITH_PARENT, sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", cluster.bridge_address, "--port",
         str(port), "--no-dashboard", "--no-show", "--protocol", scheme, *cluster.tls_arguments()],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    for host in cluster.hosts:
        # an anchor process holds the host's UTS and mount namespaces (host name, private /dev/shm)
        host.anchor = subprocess.Popen(
            [*DIE_WITH_PARENT, "ip", "netns", "exec", host.namespace, "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", f"hostname {host.hostname} && mount -t tmpfs tmpfs /dev/shm && exec sleep infinity"],
            env=env)
    deadline = time.monotonic() + timeout
    for host in cluster.hosts:  # the anchor is ready once its UTS namespace has the host's name
        while _run("nsenter", f"--uts=/proc/{host.anchor.pid}/ns/uts", "hostname", check=False).stdout.strip() \
                != host.hostname:
            if host.anchor.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"could not set up host {host.hostname} (namespace {host.namespace})")
            time.sleep(0.02)
    for host, count in zip(cluster.hosts, per_host):
        for k in range(count):
            log = open(cluster.log_dir / f"{host.hostname}-{k}.log", "wb")  # noqa: SIM115
            host.workers.append(subprocess.Popen(
                [*DIE_WITH_PARENT, "nsenter", f"--net=/run/netns/{host.namespace}", f"--uts=/proc/{host.anchor.pid}/ns/uts",
                 f"--mount=/proc/{host.anchor.pid}/ns/mnt", f"--wd={REPO_ROOT}", "--",
                 sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
                 "--host", host.address, "--name", f"{host.hostname}-{k}", "--nthreads", "1", "--no-nanny",
                 "--no-dashboard", "--death-timeout", "60", *cluster.tls_arguments()],
                env=env, stdout=log, stderr=subprocess.STDOUT))
    state = json.loads(cluster.state_file.read_text())
    state["pids"] = [p.pid for h in cluster.hosts for p in [h.anchor, *h.workers]] + [cluster.scheduler.pid]
    cluster.state_file.write_text(json.dumps(state))


def can_connect(address: str) -> bool:
    """Whether a TCP connection to ``address`` (``tcp://host:port``) opens within 0.5 s (run on a worker)."""
    host, port = address.split("://")[1].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
        return True
    except OSError:
        return False


def wait_until_hosts_reach_each_other(client, hosts: NetnsHosts, timeout: float = 20) -> None:
    """Block until a worker of each host connects to every worker of the others (after a link came back up)."""
    workers = list(scheduler_workers(client))
    deadline = time.monotonic() + timeout
    for src in hosts.hosts:
        mine = [w for w in workers if f"//{src.address}:" in w]
        others = [w for w in workers if w not in mine]
        while not all(client.run(can_connect, o, workers=mine[:1])[mine[0]] for o in others):
            assert time.monotonic() < deadline, f"{src.hostname} cannot reach the other host after the link came back"
            time.sleep(0.2)
