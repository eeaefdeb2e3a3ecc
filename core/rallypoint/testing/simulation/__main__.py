"""``python -m rallypoint.testing.simulation``: see the package."""

import sys

from rallypoint.testing.simulation import main

sys.exit(main())
