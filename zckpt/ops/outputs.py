"""What the writing operations share (a helper, not an operation: ``tests/test_structure.py`` names it): their
results and the check of the output folder made before anything is planned or written."""

from __future__ import annotations

from dataclasses import dataclass, field

from zckpt.errors import InvalidArgument
from zckpt.io import publish, storage


def check_out(out: str, overwrite: bool, source: publish.Source | None, kind: str) -> None:
    """``out`` is a local folder that is not the source and holds nothing but a previous zckpt output of ``kind``
    (when ``overwrite``): refused in one line otherwise."""
    if storage.is_url(out):
        raise InvalidArgument(f"{kind} writes to a local folder", path=out,
                              hint=f"{kind} locally, then `zckpt push` the result")
    publish.check_output(out, kind, source, overwrite)


@dataclass
class ReshardResult:
    """A reshard's (or ``convert --to deepspeed``'s) result: the output folder, the plan, what it took."""

    output: str
    plan: object
    seconds: float = 0.0
    dry_run: bool = False
    stats: dict = field(default_factory=dict)  # ranks, bytes per second, remote reads (engine.distributed.Stats)

    def to_dict(self) -> dict:
        """The fields ``--json`` prints (``to_json``, by the name every zckpt result has)."""
        return self.to_json()

    def to_json(self) -> dict:
        return {"output": self.output, "dry_run": self.dry_run, "seconds": round(self.seconds, 3),
                **self.plan.summary(), **({"stats": self.stats} if self.stats else {})}

    def __repr__(self) -> str:
        what = "would write" if self.dry_run else f"wrote in {self.seconds:.2f}s"
        return f"<ReshardResult {self.output!r}: {self.plan!r}, {what}>"


class ToDeepSpeedResult(ReshardResult):
    """A reshard's result, plus what the source held that the DeepSpeed files carry and what they do not."""

    def to_dict(self) -> dict:
        """The fields ``convert --to deepspeed --json`` prints (``from`` / ``to``: the layouts, as reshard's)."""
        return {**self.to_json(), "source_format": getattr(self.plan, "source_format", "dcp")}

    def to_json(self) -> dict:
        return {**super().to_json(), "carried": list(getattr(self.plan, "carried", [])),
                "not_carried": dict(getattr(self.plan, "not_carried", {}))}
