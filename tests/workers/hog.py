"""Allocate memory until the kernel's out-of-memory killer steps in.

Usage: hog.py
"""

import time

blocks = []
while True:
    blocks.append(bytearray(64 << 20))  # zero-filled: every page is touched
    time.sleep(0.01)
