"""What the kernel says about this process's memory: transparent huge pages, per mapping."""

from __future__ import annotations

from pathlib import Path


def thp_mode() -> str:
    """The transparent-huge-page mode ("always", "madvise", "never"; "none" without THP)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text.split("[")[1].split("]")[0] if "[" in text else "none"


def huge_kb_under(addr: int) -> int:
    """AnonHugePages of the mapping holding `addr`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0
