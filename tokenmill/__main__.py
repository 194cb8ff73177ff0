"""``python -m tokenmill``: the ``tokenmill`` command (``tokenmill serve``, ``bench``, ...)."""

import sys

from tokenmill.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
