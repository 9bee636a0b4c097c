"""Shared pieces of the thin CLI commands: options, progress bars, JSON output. No torch here."""

from __future__ import annotations

import json
import sys
import time

import click

tag_option = click.option("--tag", "-t", default=None, metavar="TAG",
                          help="Tag folder to read (default: the one named in 'latest').")
json_option = click.option("--json", "as_json", is_flag=True, help="Print a JSON object on stdout (for scripts).")
quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
storage_option = click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
                              help="fsspec option for URL paths (repeatable), e.g. endpoint_url=http://...")


def apply_storage_options(pairs) -> None:
    if pairs:
        from zckpt import storage
        storage.set_storage_options(storage.parse_storage_options(pairs))


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


class Progress:
    """A tqdm bar of bytes on stderr, driven by a library ``progress(done, total)`` callback.

    The bar (and the tqdm import) only starts once the work has run for ``delay`` seconds: short jobs print
    nothing and pay nothing."""

    def __init__(self, desc: str, enabled: bool = True, delay: float = 0.5):
        self.desc, self.enabled, self.bar = desc, enabled and sys.stderr is not None, None
        self.start, self.delay = time.monotonic(), delay

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            if time.monotonic() - self.start < self.delay:
                return
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, leave=False, dynamic_ncols=True, mininterval=0.2)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
