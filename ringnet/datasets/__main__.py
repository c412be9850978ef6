"""Run ``python -m ringnet.data`` under its alias name ``python -m ringnet.datasets``."""
from ringnet.data.__main__ import main
from ringnet.cli import run_main

if __name__ == "__main__":
    run_main(main)
