"""What ``zckpt verify`` reports: a checklist of :class:`Check` s (name, passed, detail) in a :class:`VerifyReport`,
whose first failure is the one-line error."""

from __future__ import annotations

from dataclasses import dataclass, field

from zckpt.errors import names_rendered, python_name
from zckpt.units import format_size

#: what to do when a check fails, by check name (parameters in backquotes, shown as flags by the CLI)
NEXT_STEPS = {
    "latest": "write the tag's name into 'latest' as DeepSpeed does (printf TAG > latest), or choose the tag with "
              "`tag`",
    "CRC of every entry": "the bytes of that file are damaged: copy it again from where it was saved (or a "
                          "backup), or use an earlier tag with `tag`",
    "CRC of every item": "the bytes of that .distcp file are damaged: copy it again from where it was saved (or a "
                         "backup)",
    "CRC of the other files": "the bytes of that file are damaged: copy it again from where it was saved (or a "
                              "backup)",
    "manifest": "files differ from what zckpt push sent: push again from the source, or copy them again",
    "zckpt output committed": "the output was interrupted or is still being written: run the command again",
    "safetensors headers": "a weight file is damaged or truncated: run the merge again",
    "versions agree": "the rank files come from different saves: use an earlier tag with `tag`",
    "dp_world_size": "the rank files come from different saves: use an earlier tag with `tag`",
    "shapes agree": "the rank files come from different saves or are damaged: use an earlier tag with `tag`",
    "optimizer state": "some parameters have no Adam moments: use an earlier tag with `tag`",
    "steps agree": "the rank files come from different steps: use an earlier tag with `tag`",
}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    advice: str = ""  # what to do, from a caller that knows more (the CLI: the checkpoint next to a checkpoint-N)

    @property
    def hint(self) -> str:
        """What to do about a failed check ("" when it passed)."""
        return "" if self.ok else (self.advice or NEXT_STEPS.get(self.name, ""))

    def __repr__(self) -> str:
        return f"<Check {'ok' if self.ok else 'BAD'} {self.name}: {self.detail[:80]}>"


@dataclass
class VerifyReport:
    path: str
    checks: list[Check] = field(default_factory=list)
    bytes_read: int = 0
    tag: str | None = None  # the tag checked (None: a merge output or pushed folder, which have none)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __repr__(self) -> str:
        bad = [c.name for c in self.checks if not c.ok]
        verdict = "consistent" if not bad else f"NOT consistent ({', '.join(bad[:3])})"
        read = f", read {format_size(self.bytes_read)}" if self.bytes_read else ""
        return f"<VerifyReport {self.path!r}: {verdict}, {len(self.checks)} checks{read}>"

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(name, bool(ok), detail))

    def to_dict(self, name=None) -> dict:
        """The fields ``verify --json`` prints (``to_json``, by the name every zckpt result has)."""
        return self.to_json(name)

    def to_json(self, name=None) -> dict:
        """``name``: parameter -> how the caller names it (the CLI: its flags); by default as Python passes it."""
        return {"path": self.path, "tag": self.tag, "ok": self.ok, "bytes_read": self.bytes_read,
                "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail,
                            "hint": names_rendered(c.hint, name or python_name) or None} for c in self.checks]}
