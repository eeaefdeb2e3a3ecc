"""Start ``multiprocessing`` children with each start method and check their answers; a
function of ``__main__`` is pickled by name, so spawn and forkserver re-import this script."""

import multiprocessing
import os
import sys


def square(value: int) -> int:
    return value * value


if __name__ == "__main__":
    for method in ("spawn", "forkserver", "fork"):
        with multiprocessing.get_context(method).Pool(2) as pool:
            answers = pool.map(square, [1, 2, 3])
        assert answers == [1, 4, 9], (method, answers)
        print(f"rank={os.environ['RANK']} {method} ok", flush=True)
    sys.exit(0)
