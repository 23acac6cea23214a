"""``python -m tools.kernel_report``: the same as ``scripts/kernel-report``."""

import sys

from .cli import main

sys.exit(main())
