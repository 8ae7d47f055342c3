"""A throwaway Docker daemon for `make test-deploy`, and putting the host back as it was.

dockerd changes the host beyond its own directories: it creates the docker0 bridge, adds
iptables chains and rules (filter and nat tables), and turns on IPv4 forwarding; all of
that outlives the daemon. `HostNetwork.snapshot()` records those three things first and
`restore()` undoes what changed; `differences()` says what is still not as before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from liveloop.children import stop_process

IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
FAMILIES = {"iptables": "ip", "ip6tables": "ip6"}  # command -> nft family


def _out(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


def _tables(save_output: str) -> dict[str, list[str]]:
    """iptables-save output as table -> its lines (no comments, no packet counters)."""
    tables: dict[str, list[str]] = {}
    current: list[str] = []
    for line in save_output.splitlines():
        if line.startswith("*"):
            current = tables.setdefault(line[1:], [])
        elif line and not line.startswith("#") and line != "COMMIT":
            current.append(line.split(" [")[0] if line.startswith(":") else line)
    return tables


def _is_empty(lines: list[str]) -> bool:
    """A table with only built-in chains, all ACCEPT, and no rules acts as no table."""
    return all(line.startswith(":") and line.endswith(" ACCEPT") for line in lines)


@dataclass
class HostNetwork:
    """What dockerd changes on the host: IP forwarding, iptables, the docker0 bridge."""

    ip_forward: str
    iptables: dict[str, str]  # command -> iptables-save output
    docker0: bool

    @classmethod
    def snapshot(cls) -> HostNetwork:
        saves = {cmd: _out(f"{cmd}-save") for cmd in FAMILIES if shutil.which(f"{cmd}-save")}
        return cls(IP_FORWARD.read_text().strip(), saves, Path("/sys/class/net/docker0").exists())

    def restore(self) -> None:
        """Undo dockerd's changes: bridge, iptables tables, forwarding."""
        if not self.docker0 and Path("/sys/class/net/docker0").exists():
            subprocess.run(["ip", "link", "delete", "docker0"], check=False)
        for cmd, before in self.iptables.items():
            self._restore_iptables(cmd, before)
        IP_FORWARD.write_text(self.ip_forward + "\n")

    @staticmethod
    def _restore_iptables(cmd: str, before: str) -> None:
        old = _tables(before)
        if old:  # iptables-restore replaces exactly the tables named in the snapshot
            subprocess.run([f"{cmd}-restore"], input=before, text=True, check=True)
        for table in _tables(_out(f"{cmd}-save")):
            if table in old:
                continue
            nft = shutil.which("nft")
            if nft and "nf_tables" in _out(cmd, "--version"):
                subprocess.run([nft, "delete", "table", FAMILIES[cmd], table], check=False)
                continue
            subprocess.run([cmd, "-t", table, "-F"], check=True)
            subprocess.run([cmd, "-t", table, "-X"], check=True)
            for line in _tables(_out(f"{cmd}-save", "-t", table)).get(table, []):
                if line.startswith(":"):
                    subprocess.run([cmd, "-t", table, "-P", line[1:].split()[0], "ACCEPT"])

    def differences(self) -> list[str]:
        """What differs now from the snapshot (empty: the host is as it was)."""
        now = HostNetwork.snapshot()
        diffs = []
        if now.ip_forward != self.ip_forward:
            diffs.append(f"ip_forward {self.ip_forward} -> {now.ip_forward}")
        if now.docker0 != self.docker0:
            diffs.append(f"docker0 present: {self.docker0} -> {now.docker0}")
        for cmd in self.iptables:
            old, new = _tables(self.iptables[cmd]), _tables(now.iptables.get(cmd, ""))
            for table in set(old) | set(new):
                a, b = old.get(table, []), new.get(table, [])
                if a != b and not (_is_empty(a) and _is_empty(b)):
                    diffs.append(f"{cmd} table {table}: {a} -> {b}")
        return diffs


class DockerDaemon:
    """dockerd with its data, state and socket in one directory; stopped and cleaned up."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "docker.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """DOCKER_HOST for clients."""
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 60) -> DockerDaemon:
        """Start dockerd and wait until it answers."""
        for sub in ("data", "exec"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        args = ["dockerd", "--data-root", str(self.root / "data"), "--exec-root",
                str(self.root / "exec"), "--pidfile", str(self.root / "docker.pid"),
                "-H", self.host]  # fmt: skip
        with open(self.root / "dockerd.log", "wb") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        env = {**os.environ, "DOCKER_HOST": self.host}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dockerd exited:\n{self.log()}")
            probe = subprocess.run(["docker", "info"], capture_output=True, env=env)
            if probe.returncode == 0:
                return self
            time.sleep(0.5)
        raise RuntimeError(f"dockerd not ready after {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        """The daemon's log (tail)."""
        with contextlib.suppress(OSError):
            return (self.root / "dockerd.log").read_text(errors="replace")[-4000:]
        return ""

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM (dockerd stops its containers and containerd), then remove its files."""
        proc, self.process = self.process, None
        if proc is not None:
            stop_process(proc, timeout_s)
        for mount in reversed(self.mounts()):  # normally none: dockerd unmounts on exit
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def mounts(self) -> list[str]:
        """Mount points under the daemon's directory."""
        prefix = str(self.root)
        with open("/proc/mounts") as mounts:
            return [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]


def running_docker() -> str | None:
    """Why another Docker daemon would collide with ours (None: none is running)."""
    if Path("/sys/class/net/docker0").exists():
        return "a docker0 bridge exists (another Docker daemon runs or ran without cleanup)"
    for pid in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if pid.name.isdigit() and (pid / "comm").read_text().strip() == "dockerd":
                return f"dockerd already runs (pid {pid.name})"
    return None
