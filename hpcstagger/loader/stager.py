"""The GPU stager of a shared pipeline: copies each published batch to the GPU once, for every consumer.

A pipeline built with ``device=`` has, beside its producer, one stager process per node, GPU and
pipeline. The producer starts it as a fresh interpreter (``python -m hpcstagger.loader.stager``),
never by fork: CUDA cannot be used in a process forked from one that has used it, and the producer
is forked from a consumer that usually has. The stager never sees the user's dataset: it reads the
ring's data file, which the producer fills, and

- allocates a device ring of ``window`` slots with the driver, and publishes its IPC handle in the
  control file;
- copies batch ``g`` (its descriptor and tensors, the slot's bytes as they are) from host slot
  ``g % window`` to device slot ``g % window``, from page-locked memory, waits for the copy and
  advances ``gpu_head``; consumers of the pipeline wait for ``gpu_head``, not ``head``;
- exits when the producer stops, fails or dies, freeing the device ring.

The producer overwrites a host slot only once the stager has copied the batch it held, and consumers
release a device slot only once the CUDA work they queued before taking their next batch has run, so
a device slot is never overwritten while a consumer's kernels may still read it.

A failure is written into the control file; the producer then fails the pipeline, so consumers raise it.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
import time
from typing import Any

from hpcstagger.comm import Backoff
from hpcstagger.errors import LoaderError, describe_exception
from hpcstagger.loader import _cuda, _ring as R

log = logging.getLogger(__name__)

__all__ = ["main"]

_CHECK_EVERY = 0.25
_NAP = 0.02  # the longest the stager sleeps on ``head`` without being woken


def main(argv: list[str] | None = None) -> int:
    """Run the stager of the pipeline ``argv = [root, key, ctl inode, device uuid]``."""
    root, key, ino, uuid = (argv if argv is not None else sys.argv[1:])[:4]
    dir_fd, dir_path = R.loader_dir(root, create=False)
    try:
        ctl = R.open_ctl(dir_fd, dir_path, key)
        if ctl is None or ctl.ino != int(ino):
            return 2  # the pipeline is gone already
        try:
            _Stager(ctl, dir_fd, dir_path, key, uuid).run()
        except BaseException as exc:  # every failure must reach the consumers, through the producer
            ctl.set_error(f"GPU stager (pid {os.getpid()}): {describe_exception(exc)}")
            return 1
        return 0
    finally:
        os.close(dir_fd)


class _Stager:
    def __init__(self, ctl: R.Ctl, dir_fd: int, dir_path: str, key: str, uuid: str):
        self.ctl, self.dir_fd, self.dir_path, self.key, self.uuid = ctl, dir_fd, dir_path, key, uuid
        self.window = int(ctl.w[R.H_WINDOW])
        self.checked = 0.0

    def running(self) -> bool:
        """False once the producer has stopped, failed or died (checked at most every 0.25 s)."""
        if int(self.ctl.w[R.H_STATE]) not in (R.P_STARTING, R.P_RUNNING):
            return False
        now = time.monotonic()
        if now - self.checked >= _CHECK_EVERY:
            self.checked = now
            return self.ctl.producer_alive()
        return True

    def run(self) -> None:
        import torch

        torch.set_num_threads(1)
        index = _cuda.find_device(self.uuid)
        torch.cuda.set_device(index)
        w = self.ctl.w
        while int(w[R.H_SLOT_BYTES]) == 0:  # the producer sizes the slots from its first batch
            if not self.running():
                return
            time.sleep(0.002)
        slot_bytes = int(w[R.H_SLOT_BYTES])
        fd = R.open_file(self.dir_fd, self.dir_path, self.key + ".data", create=False, size=0)
        if fd < 0:
            raise LoaderError("the pipeline's data file is gone")
        try:
            mm = mmap.mmap(fd, slot_bytes * self.window, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        pinned = _cuda.host_register(host.data_ptr(), slot_bytes * self.window)
        ring = _cuda.DeviceRing(slot_bytes * self.window, index)
        dev = None
        try:
            dev = ring.tensor()
            self.ctl.set_ipc({"handle": ring.handle(), "size": ring.size, "slot_bytes": slot_bytes,
                              "pid": os.getpid(), "pinned": pinned})
            w[R.H_GPID] = os.getpid()
            self._copy_loop(host, dev, slot_bytes)
        finally:
            torch.cuda.synchronize(index)
            del dev
            ring.free()
            if pinned:
                _cuda.host_unregister(host.data_ptr())
            del host
            mm.close()

    def _copy_loop(self, host: Any, dev: Any, slot_bytes: int) -> None:
        import torch

        w = self.ctl.w
        stream = torch.cuda.Stream()
        g = int(w[R.H_GHEAD])
        backoff = Backoff(0.0002, 0.002)
        while self.running():
            if int(w[R.H_HEAD]) <= g:  # sleep on head, flag up (the producer wakes it); look every _NAP s
                w[R.H_SWAIT] = 1
                head = int(w[R.H_HEAD])  # again, now that a publish wakes it
                if head <= g:
                    self.ctl.wait(R.H_HEAD, head, _NAP, backoff)
                w[R.H_SWAIT] = 0
                continue
            backoff.reset()
            s = g % self.window
            slot = self.ctl.slot(s)
            if int(slot[R.S_SEQ]) != g:
                raise LoaderError(f"host slot {s} holds batch {int(slot[R.S_SEQ])}, not {g} (a bug; please report it)")
            n = int(slot[R.S_NBYTES])
            base = s * slot_bytes
            with torch.cuda.stream(stream):
                dev[base:base + n].copy_(host[base:base + n], non_blocking=True)
            stream.synchronize()
            g += 1
            w[R.H_GHEAD] = g
            self.ctl.wake_consumers(R.H_GHEAD)
            self.ctl.wake_producer()  # it may wait for this batch's host slot


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
