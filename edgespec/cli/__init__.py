"""The `edgespec` command: Click commands (commands, models), the chat REPL (repl), terminal output (terminal),
the user's config file (userconfig) and `edgespec info` (info)."""

from edgespec.cli.commands import cli, main

__all__ = ["cli", "main"]
