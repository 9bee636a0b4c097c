"""Megatron-Core ``torch_dist``'s declaration in the format registry (:mod:`zckpt.state.formats`): read (claimed
before DCP: it has a ``.metadata`` too), its ``.distcp`` items' zip entries, merge's Hugging Face Llama names, the
training state placed for other formats' writers (param groups stated by the user), and its own writer
(:mod:`zckpt.megatron.writer`: a Megatron-LM save folder at any TP/PP/DP)."""

from __future__ import annotations

from zckpt.state.formats import Format


class Megatron(Format):
    name = "megatron"
    convert_options = ("tp", "pp", "layout", "megatron_args", "dp", "ddp_config", "ep")

    def claims(self, path, storage_options=None) -> bool:
        from zckpt.megatron import claims  # (not the reader: asked of every checkpoint opened)
        return claims.claims(path, storage_options)

    def preload(self) -> None:
        from zckpt.megatron import reader  # noqa: F401

    def read(self, path, tag=None, storage_options=None):
        from zckpt.megatron import reader
        return reader.read(path, tag, storage_options)

    def crc_entries(self, ckpt):
        from zckpt.megatron import entries
        return entries.crc_entries(ckpt)

    def merge_view(self, ckpt, dtype):
        from zckpt.megatron import hf_names
        return hf_names.merge_view(ckpt, dtype)

    def training_state(self, ckpt, groups, native_names=False):
        from zckpt.megatron import state
        return state.training_state(ckpt, groups, native_names)

    def side_state(self, ckpt) -> dict:
        from zckpt.megatron import state
        return state.side_state(ckpt)

    def side_files(self, ckpt) -> list:
        return []  # a save folder holds its iterations and the latest file: all Megatron's own

    def plan_convert(self, ckpt, out, options):
        if ckpt.format in ("dcp", "deepspeed"):  # a state under Hugging Face Llama names: fused back
            from zckpt.megatron import from_hf
            if options.get("ep") is not None:
                from zckpt.errors import OptionError
                raise OptionError("--ep sets a Megatron mixture-of-experts save's expert-parallel size; zckpt writes "
                                  f"Megatron MoE from Megatron sources only, this is {ckpt.format}",
                                  path=ckpt.location.input_path, hint="drop --ep")
            return from_hf.plan_from_hf(ckpt, out, options.get("tp"), options.get("pp"), options.get("layout"),
                                        options.get("side"), megatron_args=options.get("megatron_args"),
                                        dp=options.get("dp"), ddp_config=options.get("ddp_config"))
        if options.get("megatron_args") is not None:  # a Megatron source: its own scheduler and groups, never two
            from zckpt.errors import OptionError
            raise OptionError("--megatron-args does not apply to a Megatron checkpoint: its scheduler, param groups "
                              "and counters are carried as saved", path=ckpt.location.input_path,
                              hint="drop --megatron-args")
        from zckpt.megatron import writer
        return writer.plan_megatron(ckpt, out, options.get("tp"), options.get("pp"), options.get("layout"),
                                    dp=options.get("dp"), ddp_config=options.get("ddp_config"), ep=options.get("ep"))


FORMAT = Megatron()
