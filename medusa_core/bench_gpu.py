"""The synthetic step benchmark under its first name: ``python -m medusa_core.bench_gpu`` runs
``python -m medusa_core.bench_synthetic`` (it runs on the CPU too, hence the new name)."""

import sys

from .errors import exit_status
from .bench_synthetic import main

if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
