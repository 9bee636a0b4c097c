"""PyTorch DCP's declaration in the format registry (:mod:`zckpt.state.formats`): a DCP folder or a Trainer FSDP
checkpoint of two, read with the zip entries guarding its items; its side files are a Trainer checkpoint's own
(the DCP folders are what a writer replaces); its side state is what it holds beside model and optimizer."""

from __future__ import annotations

from zckpt.state.formats import Format


class Dcp(Format):
    name = "dcp"

    def claims(self, path, storage_options=None) -> bool:
        from zckpt.dcp import claims  # (not the reader: asked of every checkpoint opened)
        return claims.claims(path, storage_options)

    def preload(self) -> None:
        from zckpt.dcp import reader  # noqa: F401

    def read(self, path, tag=None, storage_options=None):
        from zckpt.dcp import reader
        return reader.read(path, tag, storage_options)

    def crc_entries(self, ckpt):
        from zckpt.dcp import entries
        return entries.crc_entries(ckpt)

    def merge_view(self, ckpt, dtype):  # the records as they are, with the folder's config.json (hf_config)
        from zckpt.dcp import hf_config
        return hf_config.merge_view(ckpt, dtype)

    def side_state(self, ckpt) -> dict:
        from zckpt.dcp import sidestate
        return sidestate.side_state(ckpt)

    def side_files(self, ckpt) -> list:
        from zckpt.dcp.sidestate import dcp_file
        from zckpt.state.files import side_files
        # a Trainer FSDP checkpoint's own files (config, trainer_state.json, scheduler.pt, RNG states); its DCP
        # folders are what another format's files replace
        return [f for f in side_files(ckpt.location, ckpt.storage_options) if not dcp_file(f.rel)]


FORMAT = Dcp()
