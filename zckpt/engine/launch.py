"""The launcher's job as one group of processes: who runs (``torchrun``, the ``deepspeed`` launcher, ``srun``),
how the ranks agree (one all-reduce of errors, every rank raises the lowest failing rank's error), and the
:class:`Group` the engine's distributed execution (:mod:`zckpt.engine.distributed`) and resume
(:mod:`zckpt.ops.resume`) coordinate through. Without a launcher nothing here runs, and torch is not imported.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterator

from zckpt import errors
from zckpt.errors import InvalidArgument, ZckptError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 4 * 3600  # a collective waits this long for the slowest rank (ZCKPT_DIST_TIMEOUT seconds)
MESSAGE_BYTES = 1024  # per rank, in the error all-reduce


# ============================================================================================ agreement


def agree(error: BaseException | None, device=None) -> None:
    """Every rank learns whether any rank failed, through one all-reduce; all raise the lowest failing rank's error.

    Each rank writes a flag and its one-line message (UTF-8, at most ``MESSAGE_BYTES``) into its own row of a
    zero ``(world, 1 + MESSAGE_BYTES)`` uint8 tensor; a SUM all-reduce gives every rank every row. Without an
    initialized process group, ``error`` is raised as it is. (Also :mod:`zckpt.ops.resume`'s agreement.)"""
    import torch
    import torch.distributed as tdist
    if not (tdist.is_available() and tdist.is_initialized()):
        if error is not None:
            raise error
        return
    world, rank = tdist.get_world_size(), tdist.get_rank()
    rows = torch.zeros((world, 1 + MESSAGE_BYTES), dtype=torch.uint8)
    if error is not None:
        kind = type(error).__name__
        if isinstance(error, ZckptError):  # message, path and hint apart: every rank renders them as the failing one
            parts = (error.message, error.path or "", error.hint or "")
        elif isinstance(error, OSError) and error.errno and error.strerror:  # an OSError again on every rank, so
            kind = f"OSError:{error.errno}"  # that the one error table names the path or output (a full disk)
            parts = (error.strerror, error.filename or "", "")
        else:
            parts = (one_line(error), "", "")
        msg = "\x00".join((kind, *(" ".join(str(p).split()) for p in parts))).encode()
        msg = msg[:MESSAGE_BYTES]
        rows[rank, 0] = 1
        rows[rank, 1:1 + len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
    if device is not None and str(device) != "cpu":
        rows = rows.to(device)
    tdist.all_reduce(rows, op=tdist.ReduceOp.SUM)
    rows = rows.cpu()
    failed = [r for r in range(world) if int(rows[r, 0])]
    if not failed:
        return
    raw = bytes(rows[failed[0], 1:].tolist()).rstrip(b"\x00").decode(errors="replace")
    cls_name, text, path, hint = (raw.split("\x00") + ["", "", ""])[:4]
    if cls_name.startswith("OSError:") and cls_name[8:].isdigit():
        err = OSError(int(cls_name[8:]), text, path or None)  # (FileNotFoundError for ENOENT ..., as raised)
    else:
        cls = getattr(errors, cls_name, None)
        if not (isinstance(cls, type) and issubclass(cls, ZckptError)):
            cls = ZckptError
        err = cls(text, path=path or None, hint=hint)
    err.ranks = failed
    if error is not None:
        raise err from error
    raise err


def one_line(error: BaseException) -> str:
    text = str(error) if isinstance(error, ZckptError) else f"{type(error).__name__}: {error}"
    return " ".join(text.split())


# ============================================================================================ the launcher


def launcher_env(env=None) -> dict | None:
    """``{"rank", "world_size", "local_rank", "launcher"}`` when this process is one of several started by a
    launcher, else None. ``ZCKPT_DISTRIBUTED=0`` turns detection off."""
    env = os.environ if env is None else env
    if env.get("ZCKPT_DISTRIBUTED", "").lower() in ("0", "no", "off", "false"):
        return None
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, the deepspeed launcher, torch's env:// convention
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        launcher = "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "env"
    elif "SLURM_PROCID" in env and env.get("SLURM_STEP_NUM_TASKS"):  # a task of an srun step (not sbatch's script)
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
        launcher = "srun"
    else:
        return None
    if world <= 1:
        return None
    if not env.get("MASTER_ADDR"):
        raise InvalidArgument(f"this is task {rank} of {world} ({launcher}) but MASTER_ADDR is not set, so the "
                              "tasks cannot coordinate",
                              hint="export MASTER_ADDR=<first node> MASTER_PORT=<free port> before srun, "
                                   "or run a single task")
    return {"rank": rank, "world_size": world, "local_rank": local, "launcher": launcher}


@dataclass
class Group:
    """The processes of one job: this one's ``rank`` of ``world``; collectives through torch.distributed (gloo)."""

    rank: int
    world: int
    launcher: str = "env"

    def agree(self, error: BaseException | None) -> None:
        """All ranks learn whether any failed; all raise the lowest failing rank's one-line error."""
        agree(error)

    def phase(self, fn: Callable, *args):
        """``fn(*args)`` on this rank, then :meth:`agree`: its result, or every rank raises the same error."""
        error, out = None, None
        try:
            out = fn(*args)
        except Exception as exc:  # noqa: BLE001 - said to every rank, raised below
            error = exc
        self.agree(error)
        return out

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank."""
        import torch
        import torch.distributed as dist
        n = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(n, 0)
        size = int(n[0])
        if not size:
            return b""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
            torch.zeros(size, dtype=torch.uint8)
        dist.broadcast(buf, 0)
        return bytes(buf.numpy())

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's ``data`` on rank 0 (in rank order); None on the other ranks."""
        import torch
        import torch.distributed as dist
        lengths = [row[0] for row in self.all_gather_ints([len(data)])]
        mine = torch.zeros(max(max(lengths), 1), dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros_like(mine) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(mine, out, dst=0)
        if self.rank != 0:
            return None
        return [bytes(t.numpy()[:n]) for t, n in zip(out, lengths)]

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of int64s (all the same length), in rank order."""
        import torch
        import torch.distributed as dist
        mine = torch.tensor(values or [0], dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [t.tolist()[:len(values)] for t in out]


@contextlib.contextmanager
def launched() -> Iterator[Group | None]:
    """The :class:`Group` of this launcher's job (process group set up, torn down at the end), or None without a
    launcher (torch is then not imported)."""
    env = launcher_env()
    if env is None:
        yield None
        return
    import datetime

    dist = errors.require_torch(f"a run of {env['world_size']} tasks under {env['launcher']} (this is task "
                                f"{env['rank']}; the tasks coordinate through torch.distributed)", "torch.distributed",
                                also="or run one task, or set ZCKPT_DISTRIBUTED=0")
    owned = not dist.is_initialized()
    if owned:
        os.environ.setdefault("MASTER_PORT", "29500")
        timeout = float(os.environ.get("ZCKPT_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
        dist.init_process_group("gloo", init_method="env://", rank=env["rank"], world_size=env["world_size"],
                                timeout=datetime.timedelta(seconds=timeout))
        # torch's import left ~150k objects that the cyclic GC would walk at every full collection, and planning
        # a checkpoint allocates enough to trigger some (0.2-0.4 s on each rank, where the single-process run,
        # without torch, pays nothing): they live as long as the process, so they are frozen out of its scans
        gc.freeze()
    try:
        yield Group(dist.get_rank(), dist.get_world_size(), env["launcher"])
    finally:
        if owned:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
