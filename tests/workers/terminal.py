"""Report whether stdout and stderr are terminals, draw a tqdm bar, then exit or raise.

Usage: terminal.py [--raise]   (--raise: the last local rank raises, after its bar)
"""

import os
import sys
import time

from tqdm import tqdm

size = os.get_terminal_size(sys.stderr.fileno()).columns if sys.stderr.isatty() else None
print(f"stdout isatty={sys.stdout.isatty()} stderr isatty={sys.stderr.isatty()} columns={size}")
print("\x1b[32mcoloured\x1b[0m")
for _ in tqdm(range(5), desc="steps", mininterval=0, miniters=1):
    time.sleep(0.05)
last = int(os.environ["LOCAL_WORLD_SIZE"]) - 1
if "--raise" in sys.argv and int(os.environ["LOCAL_RANK"]) == last:
    raise ValueError("the bar is done")
