"""Run ``python -m ringnet.data`` under its alias name ``python -m ringnet.datasets``."""
from ringnet.data.__main__ import main
from ringnet.errors import run_main

run_main(main)
