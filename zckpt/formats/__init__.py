"""Layer 2, formats: file formats read without running code. ``safeload`` (torch zip files: pickles replayed
against an allow-list), ``zipentries`` (zip structure checks), ``tensors`` (reading pieces as tensors),
``casting`` (dtype conversions bit-identical to torch)."""
