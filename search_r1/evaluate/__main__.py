"""`python -m search_r1.evaluate eval …`, as scripts/evaluate.sh runs it."""
import argparse
import logging
import sys

import search_r1.evaluate
from search_r1.evaluate.cli import add_parser

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m search_r1.evaluate",
                                     description=search_r1.evaluate.__doc__.splitlines()[0])
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    from search_r1.cli import normalize_flags, show_defaults
    show_defaults(parser)
    parsed = parser.parse_args(normalize_flags(sys.argv[1:]))
    from verl.checkpoint.manifest import CheckpointCorrupt
    try:
        parsed.func(parsed)
    except (FileNotFoundError, ValueError, CheckpointCorrupt) as error:  # the message says what to do
        sys.exit(f"{parser.prog} {parsed.cmd}: error: {error}")
