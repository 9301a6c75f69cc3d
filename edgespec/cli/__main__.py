"""`python -m edgespec.cli`: the same as the `edgespec` command."""

from edgespec.cli.commands import main

main()
