"""``python -m pdctl`` (also the ``pdctl`` console script)."""
import sys

from pdctl.cli import main

if __name__ == "__main__":
    sys.exit(main())
