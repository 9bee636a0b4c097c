"""Stand-ins for members of the enums real checkpoints name (Megatron-LM's args: ``AttnBackend.auto``,
``signal.Signals.SIGTERM`` ...): the value the pickle holds, shown by the member's name from a table read in the
class's source; the class itself is never imported. :mod:`zckpt.encoding.allowlist` maps each global to
:func:`named_enum`."""

from __future__ import annotations

from typing import Callable

from zckpt.errors import UnsafePickle


class NamedEnum(int):
    """Stand-in for a member of an allow-listed ``enum.Enum`` (Megatron-LM's ``AttnBackend.auto``): the value the
    pickle holds, shown as the member's name where the allow-list knows the class's members (from its source), else
    as ``Class(value)``; never the class itself."""

    _qualname = "?"
    _members: dict = {}

    @property
    def name(self) -> str | None:
        return self._members.get(int(self))

    def __repr__(self) -> str:
        short = self._qualname.rsplit(".", 1)[-1]
        return f"{short}.{self.name}" if self.name else f"{short}({int(self)})"

    __str__ = __repr__


class NamedStrEnum(str):
    """Stand-in for a member of an allow-listed ``(str, Enum)`` (megatron-core's ``RerunMode.VALIDATE_RESULTS``):
    its string value, shown by name like :class:`NamedEnum`."""

    _qualname = "?"
    _members: dict = {}

    @property
    def name(self) -> str | None:
        return self._members.get(str(self))

    def __repr__(self) -> str:
        short = self._qualname.rsplit(".", 1)[-1]
        return f"{short}.{self.name}" if self.name else f"{short}({str.__repr__(self)})"


def named_enum(qualname: str, members: dict | Callable[[], dict]) -> Callable:
    """``Class(value)``, as pickle rebuilds an Enum member (``REDUCE`` of the class and its value): a
    :class:`NamedEnum` (int values) or :class:`NamedStrEnum` (str values: the members' type); a value of another
    type is refused."""
    short = qualname.rsplit(".", 1)[-1]
    classes: dict[type, type] = {}

    def member(value):
        if not classes:
            table = dict(members() if callable(members) else members)
            kind = type(next(iter(table)))
            base = NamedEnum if kind is int else NamedStrEnum
            classes[kind] = type(short, (base,), {"_qualname": qualname, "_members": table})
        cls = classes.get(type(value))
        if cls is None:
            raise UnsafePickle(f"pickle builds the enum '{qualname}' from a {type(value).__name__}, not the "
                               "type of its members' values")
        return cls(value)
    return member


def signal_members() -> dict[int, str]:
    import signal
    return {s.value: s.name for s in signal.Signals}


# Megatron-LM's common.pt holds its whole args Namespace (megatron/training/arguments.py); besides plain values and
# torch dtypes its fields name these enums (found by saving through pretrain_gpt.py, megatron-core 0.16.1 and 0.19.2;
# members as the classes' source defines them). A member is its value and name, the class never imported.
MEGATRON_ENUMS: dict[str, dict] = {
    # attention_backend (default AttnBackend.auto); megatron/core/transformer/enums.py, same in 0.16 and 0.19
    "megatron.core.transformer.enums.AttnBackend": {1: "flash", 2: "fused", 3: "unfused", 4: "local", 5: "auto"},
    # cuda_graph_scope (a list; 0.16: --cuda-graph-scope, 0.19 keeps the class for older checkpoints, adds 8)
    "megatron.core.transformer.enums.CudaGraphScope": {
        1: "full_iteration", 2: "attn", 3: "mlp", 4: "moe", 5: "moe_router", 6: "moe_preprocess", 7: "mamba",
        8: "full_iteration_inference"},
    # 0.19: cuda_graph_modules (a list) and inference_cuda_graph_scope
    "megatron.core.transformer.enums.CudaGraphModule": {
        1: "attn", 2: "mlp", 3: "moe", 4: "moe_router", 5: "moe_preprocess", 6: "mamba"},
    "megatron.core.transformer.enums.InferenceCudaGraphScope": {1: "none", 2: "layer", 3: "block"},
    # model_type (pretrain sets it); megatron/core/enums.py
    "megatron.core.enums.ModelType": {1: "encoder_or_decoder"},
    # 0.19's common state holds the rerun state machine's (megatron/core/rerun_state_machine.py); its args
    # rerun_mode is a string. megatron-core lists these, the ones above and OptimizerConfig / SimpleNamespace /
    # PosixPath as the classes its checkpoints may name (megatron/core/safe_globals.py SAFE_GLOBALS)
    "megatron.core.rerun_state_machine.RerunMode": {
        "disabled": "DISABLED", "validate_results": "VALIDATE_RESULTS",
        "report_determinism_stats": "REPORT_DETERMINISM_STATS"},
    "megatron.core.rerun_state_machine.RerunDiagnostic": {
        "correct_result": "CORRECT_RESULT", "transient_error": "TRANSIENT_ERROR",
        "persistent_error": "PERSISTENT_ERROR"},
    "megatron.core.rerun_state_machine.RerunState": {
        0: "NOT_RUNNING_YET", 1: "INITIAL_RUN", 2: "RERUNNING_IN_PLACE", 3: "WILL_RERUN_FROM_CHECKPOINT",
        4: "RERUNNING_FROM_CHECKPOINT", 5: "RERUNNING_AGAIN_FROM_CHECKPOINT"},
    "megatron.core.rerun_state_machine.RerunValidationStatus": {
        "rerun_disabled": "RERUN_DISABLED", "initial_run": "INITIAL_RUN",
        "first_rerun_not_reproducible": "FIRST_RERUN_NOT_REPRODUCIBLE",
        "first_rerun_reproducible": "FIRST_RERUN_REPRODUCIBLE",
        "second_rerun_not_reproducible": "SECOND_RERUN_NOT_REPRODUCIBLE",
        "second_rerun_reproducible": "SECOND_RERUN_REPRODUCIBLE"},
}
