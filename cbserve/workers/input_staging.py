"""A step's integer inputs sent to the device in one copy, through pinned double buffers.

`tensor.to("cuda")` from ordinary (pageable) host memory returns only when the copy is done,
that is after every kernel queued before it: with async batching, preparing step N+1 would wait
for step N and nothing would overlap. `InputStaging` packs a step's inputs (token ids,
positions, slot mapping, block table, ...) into one pinned buffer and issues a single
non-blocking copy. Two buffers are used in turn: while step N+1 is packed into one, step N's copy
may still be reading the other. Before a buffer is packed again, the event recorded after its
last copy is waited on; in steady state that copy was queued two steps ago and is long done.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class InputStaging:
    def __init__(self, device: torch.device, pin: bool = True, event_factory: Callable[[], object] | None = None):
        self.device = device
        self.pin = pin
        make_event = event_factory or torch.cuda.Event
        self.buffers = [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
        self.events = [make_event(), make_event()]  # recorded after each buffer's last copy
        self.turn = 0

    def send(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of the integer host tensors `parts`, same shapes and dtypes."""
        sizes = [p.numel() for p in parts]
        total = sum(sizes)
        i, self.turn = self.turn, self.turn ^ 1
        self.events[i].synchronize()  # its previous copy has read the buffer
        if self.buffers[i].numel() < total:  # grow geometrically: a few allocations per run
            self.buffers[i] = torch.empty(max(total, 2 * self.buffers[i].numel()), dtype=torch.int64,
                                          pin_memory=self.pin)
        staged = self.buffers[i][:total]
        for part, chunk in zip(parts, staged.split(sizes)):
            chunk.copy_(part.reshape(-1))
        # On a CPU (tests) .to() would alias the buffer: copy, as the device copy would.
        flat = staged.to(self.device, non_blocking=True) if self.device.type != "cpu" else staged.clone()
        self.events[i].record()
        return [chunk.view(part.shape).to(part.dtype) for part, chunk in zip(parts, flat.split(sizes))]
