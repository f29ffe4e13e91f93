"""`make bench`: run every benchmark script in this folder, one after the other.

Each script prints its own figures as ratios against a baseline measured in the same process.
"""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    failed = []
    for script in sorted(HERE.glob("bench_*.py")):
        print(f"== {script.name}", flush=True)
        if subprocess.call([sys.executable, str(script)], cwd=HERE.parent) != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
