"""``python -m gateway --help``."""
from gateway.server import main

if __name__ == "__main__":
    main()
