"""``python -m hpcstagger`` is the ``hpcstagger`` command."""

import sys

from hpcstagger.cli import main

if __name__ == "__main__":
    sys.exit(main())
