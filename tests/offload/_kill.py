"""Kill -9 a block writer (``_writer.py``) mid-stream; what it had reported as stored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

WRITER = Path(__file__).with_name("_writer.py")


def kill_writer(store: Path, *mode: str, after: int = 25) -> list[str]:
    """Start the writer on ``store`` (``mode``: its extra argv), SIGKILL it once it has
    reported ``after`` blocks, and return every line it reported (before and as it died)."""
    p = subprocess.Popen([sys.executable, str(WRITER), str(store), *mode], stdout=subprocess.PIPE, text=True)
    reported = []
    for line in p.stdout:
        reported.append(line.strip())
        if len(reported) >= after:
            break
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    return reported + [ln.strip() for ln in p.stdout.read().splitlines() if ln.strip()]
