"""Readers of DeepSpeed's on-disk formats (discovery, ZeRO-1/2, BF16 optimizer, ZeRO-3)."""
