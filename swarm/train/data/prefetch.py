"""Batches prepared ahead of the step that uses them: a background thread draws the next batches from the
sampler (and pins them when they go to a CUDA device) while the device computes.

It draws exactly the batches asked for, in the sampler's order, so the sampler's position after a call is
what it would be without prefetching: a checkpoint taken between calls resumes at the same batch.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


def batches(
    draw: Callable[[], Batch], count: int, device: torch.device, *, prefetch: bool = True, depth: int = 2
) -> Iterator[Batch]:
    """``count`` batches from ``draw`` on ``device``; with ``prefetch``, drawn ``depth`` ahead on a
    thread. Stop early and the thread finishes the batches it was asked for, then exits."""
    pin = device.type == "cuda"
    if not prefetch or count <= 1:
        for _ in range(count):
            yield _to_device(draw(), device, pin)
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)

    def produce() -> None:
        try:
            for _ in range(count):
                x, y = draw()
                ready.put((x.pin_memory(), y.pin_memory()) if pin else (x, y))
        except BaseException as e:  # re-raised in the consumer
            ready.put(e)

    thread = threading.Thread(target=produce, name="swarm-prefetch", daemon=True)
    thread.start()
    try:
        for _ in range(count):
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            yield _to_device(item, device, pin=False)
    finally:
        while thread.is_alive():  # an early stop: let the producer put its last batches and exit
            try:
                ready.get(timeout=0.1)
            except queue.Empty:
                pass
        thread.join()


def _to_device(batch: Batch, device: torch.device, pin: bool) -> Batch:
    x, y = batch
    if device.type == "cpu":
        return x, y
    if pin:
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
