"""Layer 2, formats: file formats read without running code. ``safeload`` (torch zip and legacy files: pickles
replayed against an allow-list), ``zipentries`` (zip structure checks), ``legacy`` (the layout of non-zip torch
files), ``pickles`` (pickle streams walked without running them), ``tensors`` (reading pieces as tensors),
``casting`` (dtype conversions bit-identical to torch)."""
