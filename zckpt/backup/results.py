"""What a push reports: :class:`PushEvent` (progress, to the ``progress`` callback, from worker threads),
:class:`CheckpointResult` (one checkpoint's outcome) and :class:`PushResult` (a whole push's).
"""

from __future__ import annotations

import dataclasses

def human_bytes(n: float) -> str:
    from zckpt.units import format_size  # the one size style of every command

    return format_size(n)


@dataclasses.dataclass
class PushEvent:
    """One progress report. ``kind``: checkpoint-start (``total`` bytes to send), bytes (``nbytes`` sent),
    file-done, checkpoint-done (``result``), skipped (``message``), waiting (settle), retry, removed."""

    kind: str
    checkpoint: str = ""
    path: str = ""
    nbytes: int = 0
    total: int = 0
    files: int = 0
    message: str = ""
    result: CheckpointResult | None = None


@dataclasses.dataclass
class CheckpointResult:
    name: str
    status: str  # pushed | up-to-date | incomplete | unsettled | skipped | failed | not-tried (DEST unreachable)
    #              | interrupted | dry-run | vanished
    reason: str = ""
    step: int | None = None
    dest: str = ""
    files_total: int = 0
    bytes_total: int = 0
    files_sent: int = 0
    bytes_sent: int = 0
    files_skipped: int = 0
    bytes_skipped: int = 0
    seconds: float = 0.0
    error: BaseException | None = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["error"] = str(self.error) if self.error else None
        return out

    def __repr__(self) -> str:
        return f"<CheckpointResult {self.summary()[:200]}>"

    def summary(self) -> str:
        """One line for humans."""
        label = self.name or "SRC"  # SRC itself is the checkpoint
        if self.status == "pushed":
            rate = self.bytes_sent / self.seconds if self.seconds > 0 else 0
            text = (f"{label}: pushed {self.files_sent} file(s), {human_bytes(self.bytes_sent)} in "
                    f"{self.seconds:.1f}s ({human_bytes(rate)}/s)")
            if self.files_skipped:
                text += f", {self.files_skipped} already there"
            return text + f" -> {self.dest}"
        if self.status == "up-to-date":
            return f"{label}: up to date ({self.files_total} file(s), {human_bytes(self.bytes_total)})"
        if self.status == "dry-run":
            return (f"{label}: would send {self.files_sent} file(s), {human_bytes(self.bytes_sent)}"
                    f" ({self.files_skipped} already there) -> {self.dest}")
        return f"{label}: {self.status}" + (f" ({self.reason})" if self.reason else "")


@dataclasses.dataclass
class PushResult:
    src: str
    dest: str
    checkpoints: list[CheckpointResult] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    root_files_sent: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    dry_run: bool = False

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for c in self.checkpoints:
            counts[c.status] = counts.get(c.status, 0) + 1
        states = ", ".join(f"{n} {s}" for s, n in counts.items()) or "no checkpoints"
        return (f"<PushResult {self.src!r} -> {self.dest!r}: {states}; sent {self.files_sent} file(s), "
                f"{human_bytes(self.bytes_sent)}{' (dry run)' if self.dry_run else ''}>")

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.checkpoints if c.status == "pushed")

    @property
    def files_sent(self) -> int:
        return sum(c.files_sent for c in self.checkpoints if c.status == "pushed")

    @property
    def failed(self) -> list[CheckpointResult]:
        return [c for c in self.checkpoints if c.status in ("failed", "not-tried", "interrupted")]

    def to_dict(self) -> dict:
        return {"src": self.src, "dest": self.dest, "dry_run": self.dry_run, "seconds": round(self.seconds, 3),
                "files_sent": self.files_sent, "bytes_sent": self.bytes_sent,
                "checkpoints": [c.to_dict() for c in self.checkpoints], "removed": list(self.removed),
                "root_files_sent": list(self.root_files_sent)}
