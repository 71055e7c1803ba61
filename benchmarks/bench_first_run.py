"""The README's main job, timed: `lessmem eval` with no arguments, quiet and beside a busy process.

Each run is a fresh `lessmem eval` process (the built-in model from its cache, the default
quick protocol); wall and CPU seconds come from the child's resource usage. The
"contended" run has one CPU-bound Python busy loop beside it for its whole length.

    python benchmarks/bench_first_run.py            # the default eval, 2 rounds
    python benchmarks/bench_first_run.py --quick    # one short eval per condition (CI)
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import header, parser, write_result  # noqa: E402

QUICK_ARGS = ("--kv", "int8", "--window-len", "64", "--windows", "1")


def timed_eval(args: tuple, busy: bool) -> dict:
    """Wall and CPU seconds of one `lessmem eval` child (``busy``: a busy loop beside it)."""
    competitor = subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) if busy else None
    try:
        if competitor is not None:
            time.sleep(0.3)  # let it get onto a core
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "lessmem", "eval", *args], capture_output=True,
                              text=True, env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"lessmem eval exited {proc.returncode}: {proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "table_rows": proc.stdout.count("\n"),
            "stage_lines": proc.stderr.count("[eval]")}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="runs per condition (default 2; quick 1)")
    args = p.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    eval_args = QUICK_ARGS if args.quick else ()
    h = header(command="lessmem eval " + " ".join(eval_args), rounds=rounds,
               competitor="one Python busy loop")
    runs = {"quiet": [], "contended": []}
    for _ in range(rounds):  # alternate, so drift on the machine hits both alike
        for cond in runs:
            runs[cond].append(timed_eval(eval_args, busy=cond == "contended"))
    out = {cond: {"wall_s": statistics.median(r["wall_s"] for r in rs),
                  "cpu_s": statistics.median(r["cpu_s"] for r in rs), "runs": rs}
           for cond, rs in runs.items()}
    out["contended_vs_quiet_wall"] = out["contended"]["wall_s"] / out["quiet"]["wall_s"]
    for cond in ("quiet", "contended"):
        print(f"{cond:<10} wall {out[cond]['wall_s']:6.1f} s  cpu {out[cond]['cpu_s']:6.1f} s")
    write_result("bench_first_run", {"header": h, **out}, args.out, args.quick)


if __name__ == "__main__":
    main()
