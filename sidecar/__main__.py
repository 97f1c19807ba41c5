"""``python -m sidecar`` is the ``hami-mig-sidecar`` console script (tests start the sidecar this way)."""

import sys

from sidecar.cli import main

sys.exit(main())
