"""Memory as the machine sees it while edgechat runs: this process's resident set (/proc), the
machine's MemAvailable, and the limit and usage of the memory cgroup the process is in (v2's
memory.max / memory.current, v1's memory.limit_in_bytes / memory.usage_in_bytes), where one is
set: a container's or a systemd unit's limit is what the OOM killer enforces, not the RAM."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from edgechat.models.planner import available_memory

#: v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is none
_UNLIMITED = 1 << 62
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryReading:
    rss: int | None  # this process, bytes
    available: int  # the machine's MemAvailable (the planner's reading of it)
    cgroup_limit: int | None  # None: no limit set (or no cgroup to read)
    cgroup_usage: int | None

    def headroom(self) -> int | None:
        """Bytes that may still be taken before the first limit: the cgroup's or the machine's."""
        room = [r for r in (self.available, None if self.cgroup_limit is None or self.cgroup_usage is None
                            else self.cgroup_limit - self.cgroup_usage) if r is not None]
        return min(room) if room else None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def process_rss(pid: int | str = "self") -> int | None:
    """Resident set size in bytes (VmRSS), None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cgroup_files(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[Path, Path] | None:
    """(limit file, usage file) of this process's memory cgroup: v1's memory controller where
    it is mounted, else v2's unified hierarchy; None where there is neither."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if "memory" in controllers.split(","):
            for base in (root / "memory" / rel, root / "memory"):  # the path, or a namespaced root
                if (base / "memory.limit_in_bytes").is_file():
                    return base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
        elif controllers == "":
            for base in (root / rel, root):
                if (base / "memory.max").is_file():
                    return base / "memory.max", base / "memory.current"
    return None


def read(root: Path = CGROUP_ROOT) -> MemoryReading:
    files = cgroup_files(root)
    limit = usage = None
    if files is not None:
        limit, usage = _read_int(files[0]), _read_int(files[1])
        if limit is not None and limit >= _UNLIMITED:
            limit = None  # v2 writes "max", which reads as None already
    return MemoryReading(process_rss(os.getpid()), available_memory(), limit, usage)
