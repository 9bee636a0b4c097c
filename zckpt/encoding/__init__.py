"""Layer 2, encoding: how bytes are laid out in the files every format is made of, read without running code. ``safeload`` (torch zip and legacy files: pickles
replayed against an allow-list, ``allowlist``, into ``lazytensor`` descriptions), ``zipentries`` (zip structure
checks), ``legacy`` (the layout of non-zip torch files), ``pickles`` (pickle streams walked without running them), ``dcpmeta`` / ``distcp`` (DCP's ``.metadata`` and the
torch-zip items of its ``.distcp`` files), ``tensors`` (reading pieces as tensors),
``casting`` (dtype conversions bit-identical to torch)."""
