"""`python -m ostinato.server --model tiny --port 8000`: the same as `ostinato serve`."""

import sys

from ostinato.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
