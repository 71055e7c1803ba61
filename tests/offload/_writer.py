"""Subprocess for the kill -9 tests: put blocks forever, print each key once it is
acknowledged. argv: store-dir [mode [prefix]]; mode "sync" (default): once ``put``
returned; "async": once ``put_async``'s future completed (the block is durable);
"hold": write 8 session-private and 8 shareable blocks, print "ready", then wait to be
killed (the orphan tests)."""

import sys
import threading
import time

import torch

torch.set_num_threads(1)

from lessmem.offload import DiskTier  # noqa: E402

tier = DiskTier(sys.argv[1])
mode = sys.argv[2] if len(sys.argv) > 2 else "sync"
prefix = sys.argv[3] if len(sys.argv) > 3 else "blk"


def block(i):
    return {"x": torch.full((20000,), float(i)), "i": torch.tensor([i])}


if mode == "hold":
    for i in range(8):
        tier.put(f"s{prefix}-b{i:05d}-L00", block(i))  # prefix: 16 hex digits, the session
        tier.put(f"shared{i}", block(i))
    print("ready", flush=True)
    time.sleep(600)
out = threading.Lock()


def report(key):
    def done(fut):
        if fut.exception() is None:
            with out:
                print(key, flush=True)
    return done


i = 0
while True:
    key = f"{prefix}{i:06d}"
    if mode == "async":
        tier.put_async(key, block(i)).add_done_callback(report(key))
    else:
        tier.put(key, block(i))
        print(key, flush=True)
    i += 1
