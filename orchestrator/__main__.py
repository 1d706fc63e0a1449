"""`python -m orchestrator` → the command line (cli.py) with `serve` from the HTTP layer (server/__main__.py):
this launcher is the one module of orchestrator/ that imports server/."""

import sys

from server.__main__ import main

sys.exit(main())
