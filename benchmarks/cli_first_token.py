"""What a user waits for at the command line: `nanoplug generate` on the default model, from the command to its
first byte of output (the first token) and to its exit, on a machine that has run nanoplug before (one untimed
run first fills the caches), and the refusal of a misspelt plugin name. Prints the CPU's model and flags with
the figures: a CPU figure means little without them.

    python benchmarks/cli_first_token.py                 # 5 runs each
    python benchmarks/cli_first_token.py --runs 3 --tokens 8
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_gguf import cpu_name  # noqa: E402
def timed(args: list[str]) -> tuple[float, float, int]:
    """(seconds to the first byte on stdout, seconds to exit, exit code)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "nanoplug", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    first_at = time.perf_counter() - start
    proc.communicate()
    return (first_at if first else float("nan")), time.perf_counter() - start, proc.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt", default="The capital of France is")
    args = ap.parse_args()
    generate = ["generate", "-n", str(args.tokens), args.prompt]
    _, _, rc = timed(generate)  # warms the caches (the GGUF's checkpoint folder, kernel builds, the config)
    if rc:
        print(f"nanoplug generate failed (exit {rc})")
        return rc
    firsts, ends = zip(*[timed(generate)[:2] for _ in range(args.runs)])
    refusals = [timed(["generate", "--attention", "flsh", "hi"])[1] for _ in range(args.runs)]
    print(f"CPU: {cpu_name()}; load average {os.getloadavg()[0]:.2f}")
    print(f"`nanoplug {' '.join(generate[:3])} ...`, {args.runs} runs: first token median {statistics.median(firsts):.2f} s "
          f"(min {min(firsts):.2f}, max {max(firsts):.2f}); exit median {statistics.median(ends):.2f} s")
    print(f"a misspelt plugin name refused: median {statistics.median(refusals):.2f} s (max {max(refusals):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
