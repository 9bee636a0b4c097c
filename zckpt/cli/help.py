"""``zckpt help``: the guides installed with zckpt (a wheel puts docs/*.md in <prefix>/share/doc/zckpt)."""

from __future__ import annotations

import os
import sys

import click

from zckpt.cli._common import emit_json, global_options
from zckpt.errors import InvalidArgument


def docs_folder() -> str | None:
    """Where the guides are: installed with the wheel (``<prefix>/share/doc/zckpt``), else the source tree's docs/."""
    import site

    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.join(sys.prefix, "share", "doc", "zckpt"),
                  os.path.join(getattr(site, "USER_BASE", "") or "", "share", "doc", "zckpt"),
                  os.path.join(here, os.pardir, os.pardir, "docs")]
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "guide.md")):
            return os.path.normpath(folder)
    return None


def _title(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("# "):
                return line[2:].strip().replace("`", "")
    return ""


@click.command("help", epilog="""\b
Examples:
  zckpt help                 # the topics, and where they are
  zckpt help guide           # set-up, every command, the Python API
  zckpt help json            # the --json schema of every command
  zckpt help --json          # the topics as JSON (with TOPIC: its text)""")
@click.argument("topic", required=False)
@global_options()
def help_command(topic, as_json, quiet):
    """Read zckpt's guides in the terminal: the user guide, the command reference, the --json schemas, push,
    reshard, estimate, layouts.

    Without TOPIC, lists the topics. On a terminal a guide is shown through $PAGER (default: less); piped, it is
    printed as it is. Every option of a command is also in zckpt COMMAND --help.
    """
    folder = docs_folder()
    if folder is None:
        raise InvalidArgument("the guides are not installed with this zckpt",
                              hint="zckpt COMMAND --help describes every option")
    topics = {name[:-3]: os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith(".md")}
    if topic is not None and topic not in topics:
        raise InvalidArgument(f"no topic {topic!r}", param="TOPIC", hint=f"one of: {', '.join(topics)}")
    if as_json:
        text = None
        if topic is not None:
            with open(topics[topic], encoding="utf-8") as fh:
                text = fh.read()
        emit_json({"path": topics[topic] if topic else folder, "topic": topic, "text": text,
                   "topics": [{"name": name, "title": _title(path)} for name, path in topics.items()]})
        return
    if topic is None:
        width = max(len(t) for t in topics)
        for name, path in topics.items():
            click.echo(f"{name:<{width}}  {_title(path)}")
        click.echo(f"\n(in {folder}; read one with: zckpt help TOPIC)")
        return
    with open(topics[topic], encoding="utf-8") as fh:
        text = fh.read()
    if sys.stdout.isatty() and sys.stdin.isatty():  # a guide is hundreds of lines: $PAGER (else less) on a terminal
        click.echo_via_pager(text)
    else:  # a pipe or a file gets the text as it is
        click.echo(text, nl=False)
