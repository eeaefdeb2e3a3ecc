"""Write this worker's pid to DIR/<local rank>.pid, then sleep until signalled or killed.

Usage: sleeper.py DIR [ignore-term]
"""

import os
import signal
import sys
import time
from pathlib import Path

if "ignore-term" in sys.argv[2:]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
directory = Path(sys.argv[1])
(directory / f"{os.environ['LOCAL_RANK']}.pid").write_text(str(os.getpid()))
time.sleep(600)
