"""Render docs/cli.md from the live ``--help`` of every command: ``python -m zckpt.cli._docs > docs/cli.md``.

A test regenerates it and compares, so the reference cannot go stale.
"""

from __future__ import annotations

import click

from zckpt.cli import main


def _help(cmd: click.Command, name: str, parent: click.Context | None = None) -> str:
    # as the CLI itself builds them: sub-command contexts inherit the group's settings (-h, widths)
    ctx = click.Context(cmd, info_name=name, parent=parent, terminal_width=100, max_content_width=100,
                        **({} if parent else main.context_settings))
    return cmd.get_help(ctx)


def render_reference() -> str:
    root = click.Context(main, info_name="zckpt", terminal_width=100, **main.context_settings)
    parts = ["# zckpt command reference", "",
             "Generated from the live `--help` (`python -m zckpt.cli._docs`): every option of every command, as "
             "`zckpt COMMAND --help` prints it.", "",
             "## zckpt", "", "```text", main.get_help(root), "```", ""]
    for name in main.list_commands(root):
        cmd = main.get_command(root, name)
        parts += [f"## zckpt {name}", "", "```text", _help(cmd, name, root), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render_reference(), end="")
