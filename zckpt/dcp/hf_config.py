"""The Hugging Face ``config.json`` beside a DCP folder, carried by ``merge``: an FSDP2 run of a transformers model
(an MoE class's fused experts included) saves ``model.<name>`` under the class's own names, so the merged
``model.safetensors`` loads with ``from_pretrained`` once its config is beside it. The file is the DCP folder's own
(the user's ``model.config.save_pretrained(ckpt_dir)``), its ``dtype`` set to the merge's; a Trainer checkpoint's
is the Trainer's (merge copies those itself). Without one, merge writes the weights only, as before."""

from __future__ import annotations

import json

from zckpt.io import links, storage
from zckpt.state.model import Checkpoint

CONFIG = "config.json"
_DTYPE = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
          "float16": "float16"}


def merge_view(ckpt: Checkpoint, dtype: str) -> tuple[Checkpoint, dict[str, bytes], list[str]]:
    """``(ckpt, {"config.json": bytes}, notes)``: the records as they are, the folder's config.json (when it has
    one that is a JSON object and the checkpoint is not a Trainer's), with a note saying so."""
    notes = list(ckpt.extra.get("merge_notes") or [])
    loc, opts = ckpt.location, ckpt.storage_options
    path = storage.join(loc.input_path, CONFIG)
    if loc.trainer_dir or not storage.isfile(path, opts):
        return ckpt, {}, notes
    links.check([path], loc.input_path)  # a side file that is a link out of the checkpoint
    try:
        cfg = json.loads(storage.read_bytes(path, opts))
    except (ValueError, UnicodeDecodeError):
        return ckpt, {}, notes + [f"{path} is not valid JSON: not copied"]
    if not isinstance(cfg, dict):
        return ckpt, {}, notes + [f"{path} is not a JSON object: not copied"]
    for k in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]:
        cfg[k] = _DTYPE.get(dtype, dtype)
    notes.append(f"config.json copied from the DCP folder (dtype {_DTYPE.get(dtype, dtype)})")
    return ckpt, {CONFIG: (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()}, notes
