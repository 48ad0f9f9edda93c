"""`python -m search_r1.demo`, as `make demo` runs it."""
import sys

from search_r1.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
