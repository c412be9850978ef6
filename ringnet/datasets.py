"""python -m ringnet.datasets: an alias of ``python -m ringnet.data`` (download, convert, info)."""
from ringnet.data.__main__ import UsageError, info, main
from ringnet.errors import run_main

__all__ = ["main", "info", "UsageError"]

if __name__ == "__main__":
    run_main(main)
