"""``python -m ringnet.datasets``: an alias of ``python -m ringnet.data`` (download, convert, info)."""
from ringnet.data.__main__ import UsageError, info, main

__all__ = ["main", "info", "UsageError"]
