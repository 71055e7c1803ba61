"""Host-to-GPU staging of a layer's blocks on a side CUDA stream, without a host sync.

On CUDA the tiered cache's attention reads blocks from device memory; blocks held in a
lower tier (the host tier's pinned buffers, or a disk/Redis block just read) must be copied
up first. :class:`CudaStager` issues those copies with ``non_blocking=True`` on a stream of
its own and records an event after them; the layer that reads them makes the compute
stream wait for that event (``Staged.ready``: a GPU-side wait, the host never blocks) and
marks each copy as used by the compute stream (``record_stream``, so the caching allocator
does not hand the memory out again before the attention that reads it has run).

With the prefetcher in "gather" mode (what "auto" picks on CUDA) the copies of layer i+1
are issued from the prefetch thread while layer i computes, so two layers' blocks are
staged at a time (double buffering: the budget's ``staged`` and ``in_flight`` counts hold
both) and the PCIe transfer overlaps the compute; the copy engine does the moving, the
thread only issues. Blocks already on the device are passed through by reference.
Copies from pageable (unpinned) host memory are still correct, only not asynchronous: the
host tier pins its blocks up to its ``pinned_pool`` (``offload.HostTier``).

On a CPU-only machine nothing here runs: the reader moves blocks with ``to_device`` (a
no-op when the device is the CPU).
"""

from __future__ import annotations

import threading

import torch


class Staged:
    """Blocks being copied to the GPU: ``ready()`` returns them once the compute stream
    will see them (it waits on the copy's event, on the GPU)."""

    def __init__(self, parts: list[dict], copied: list[torch.Tensor], event, device):
        self.parts, self._copied, self._event, self._device = parts, copied, event, device

    def ready(self) -> list[dict]:
        if self._event is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(self._event)
            for t in self._copied:  # used by the compute stream from now on
                t.record_stream(stream)
            self._event, self._copied = None, []
        return self.parts


class CudaStager:
    """Copies blocks to a CUDA device on a side stream (one per device, made on first use)."""

    def __init__(self):
        self._streams: dict = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device):
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device)
            return s

    def stage(self, parts: list[dict], device: torch.device) -> Staged:
        """Issue the copies of every tensor of ``parts`` not already on ``device``."""
        if all(t.device == device for p in parts for t in p.values()):
            return Staged(parts, [], None, device)
        stream = self._stream(device)
        # the copies must not start before the compute stream has produced what they read
        # (a partial block written this step lives on the device already: passed through)
        stream.wait_stream(torch.cuda.current_stream(device))
        out, copied = [], []
        with torch.cuda.stream(stream):
            for p in parts:
                q = {}
                for n, t in p.items():
                    if t.device == device:
                        q[n] = t
                    else:
                        q[n] = t.to(device, non_blocking=True)
                        copied.append(q[n])
                out.append(q)
            event = torch.cuda.Event()
            event.record(stream)
        return Staged(out, copied, event, device)


def ready(hist):
    """``hist`` as parts the compute stream can read: a ``Staged`` waits (on the GPU) for its
    copies, anything else (parts already on the device, or None) is returned as it is."""
    return hist.ready() if isinstance(hist, Staged) else hist
