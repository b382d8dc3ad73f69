"""The `arborspec` command line: argparse and one module per command; the only code that sees argparse."""
