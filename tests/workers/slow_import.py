"""A module that takes SECONDS to import: preloaded (``--preload slow_import``), it keeps a
node that joins a running job getting ready beside it for that long."""

import time

SECONDS = 6.0
time.sleep(SECONDS)
