"""``python -m launcher``: the local stack behind ``make up``."""
from launcher.run import main

if __name__ == "__main__":
    main()
