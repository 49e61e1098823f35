"""``python -m leapquant_cli ...``: the ``leapquant`` command line."""

import sys

from leapquant_cli import main

sys.exit(main())
