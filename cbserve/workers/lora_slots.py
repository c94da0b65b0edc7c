"""The engine's LoRA adapters: every loaded adapter in host memory, and at most `max_loras` of them
resident in the adapted projections' slots (`kernels/lora.py`), least recently used evicted.

Each load gets a new integer id, never reused in this engine: requests carry it (`Request.lora_id`),
the prefix cache roots its hash chains on it (pages of one adapter are never another's, nor those
of an adapter unloaded and loaded again under the same name), and the scheduler admits requests of
at most `max_loras` adapters into the running set, so that one step's adapters are always resident
together. Before each pass, `prepare` makes the step's adapters resident (copying evicted ones
back from host memory) and sets each row's slot.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from cbserve.errors import InvalidRequestError
from cbserve.kernels import lora
from cbserve.workers import lora_adapter
from cbserve.workers.lora_adapter import LoraAdapter


def projections(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """The projections LoRA adapts: model module name -> (parent module, attribute)."""
    found = {}
    for name, module in model.named_modules():
        parent, _, attribute = name.rpartition(".")
        if attribute in lora_adapter.PROJECTIONS and type(module) is torch.nn.Linear:
            found[name] = (model.get_submodule(parent), attribute)
    return found


class LoraSlots:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.batch = lora.LoraBatch()
        self.places = projections(model)
        if not self.places:
            raise ValueError(f"enable_lora: {type(model).__name__} has no nn.Linear projections named "
                             f"{', '.join(lora_adapter.PROJECTIONS)} for adapters to adapt")
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        width = max_loras * max_rank
        self.layers = {name: lora.LoraLinear(getattr(parent, attr), width, self.batch)
                       for name, (parent, attr) in self.places.items()}
        self.adapters: dict[str, LoraAdapter] = {}  # by name, in host memory
        self.ids: dict[str, int] = {}
        self._by_id: dict[int, LoraAdapter] = {}
        self._next_id = 1
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recently used first
        self._lock = threading.Lock()  # loads from callers' threads, residency on the engine's
        self.num_loads = self.num_evictions = 0  # copies into slots, and slots taken from an adapter
        self._slot_of_column = torch.arange(width) // max_rank

    # -- the model -------------------------------------------------------------------------------

    def attach(self) -> None:
        """Put the adapted projections in the model, around its current ones (before packing)."""
        for name, (parent, attribute) in self.places.items():
            layer = self.layers[name]
            layer.base = getattr(parent, attribute)
            setattr(parent, attribute, layer)

    def detach(self) -> None:
        """Give the model its projections back (after unpacking)."""
        for name, (parent, attribute) in self.places.items():
            setattr(parent, attribute, self.layers[name].base)

    # -- loading -----------------------------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> int:
        """Read a PEFT adapter folder into host memory under `name`; returns its id."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name", f"an adapter name must be a non-empty string, got {name!r}")
        if name in self.ids:
            raise InvalidRequestError("lora_name", f"an adapter named {name!r} is already loaded (unload it first)")
        shapes = {n: (layer.a.shape[1], layer.b.shape[0]) for n, layer in self.layers.items()}
        try:
            adapter = lora_adapter.read(path, name, self.max_rank, shapes, self.dtype)
        except lora_adapter.LoraFormatError as error:
            raise InvalidRequestError("lora_path", str(error)) from error
        with self._lock:
            if name in self.ids:
                raise InvalidRequestError("lora_name", f"an adapter named {name!r} is already loaded")
            lora_id, self._next_id = self._next_id, self._next_id + 1
            self.adapters[name], self.ids[name], self._by_id[lora_id] = adapter, lora_id, adapter
        return lora_id

    def unload(self, name: str) -> None:
        """Forget an adapter (the caller made sure no live request uses it)."""
        with self._lock:
            lora_id = self.ids.pop(name, None)
            if lora_id is None:
                raise InvalidRequestError("lora_name", f"no adapter named {name!r} is loaded "
                                          f"(loaded: {sorted(self.ids)})")
            del self.adapters[name], self._by_id[lora_id]
            self.resident.pop(lora_id, None)  # its slot is free; no row refers to it any more

    def resolve(self, value: str | None) -> int | None:
        """A request's `lora`: the name of a loaded adapter, or the folder of one (loaded under
        its path as name); None: the base model."""
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise InvalidRequestError("lora", f"lora must be an adapter name or folder, got {value!r}")
        lora_id = self.ids.get(value)
        if lora_id is not None:
            return lora_id
        if Path(value, lora_adapter.CONFIG_FILE).is_file():
            return self.load(value, value)
        raise InvalidRequestError("lora", f"unknown LoRA adapter {value!r}: neither a loaded adapter (loaded: "
                                  f"{sorted(self.ids)}) nor a PEFT adapter folder")

    # -- each step -------------------------------------------------------------------------------

    def prepare(self, rows: list[tuple[int | None, int]]) -> None:
        """A step's rows, as (lora id or None, number of rows) per request in row order: its
        adapters made resident, each row's mask set for the projections."""
        used = {lora_id for lora_id, _ in rows if lora_id is not None}
        if not used:
            self.batch.mask = None
            return
        with self._lock:
            slots = self._make_resident(used)
        row_slots = torch.cat([torch.full((n,), -1 if i is None else slots[i]) for i, n in rows])
        mask = self._slot_of_column[None, :] == row_slots[:, None]
        self.batch.mask = mask.to(device=self.device, dtype=self.dtype)

    def end_step(self) -> None:
        self.batch.mask = None

    def _make_resident(self, used: set[int]) -> dict[int, int]:
        """Slots for the step's adapters (at most `max_loras`: the scheduler's admission), loading
        the missing ones into free slots or those of the least recently used adapters not in it."""
        for lora_id in used & self.resident.keys():
            self.resident.move_to_end(lora_id)
        for lora_id in sorted(used - self.resident.keys()):
            free = sorted(set(range(self.max_loras)) - set(self.resident.values()))
            if free:
                slot = free[0]
            else:
                victim = next(v for v in self.resident if v not in used)
                slot = self.resident.pop(victim)
                self.num_evictions += 1
            self._copy_in(self._by_id[lora_id], slot)
            self.resident[lora_id] = slot
            self.num_loads += 1
        return {lora_id: self.resident[lora_id] for lora_id in used}

    def _copy_in(self, adapter: LoraAdapter, slot: int) -> None:
        """The adapter's factors into `slot`'s columns of every projection (zeros where it has none,
        and past its rank)."""
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        r = adapter.rank
        for name, layer in self.layers.items():
            layer.a[cols].zero_()
            layer.b[:, cols].zero_()
            factors = adapter.weights.get(name)
            if factors is not None:
                layer.a[cols][:r].copy_(factors[0])
                layer.b[:, cols][:, :r].copy_(factors[1])

    def stats(self) -> dict[str, int]:
        return {"lora_loaded": len(self.adapters), "lora_resident": len(self.resident),
                "lora_slot_loads": self.num_loads, "lora_evictions": self.num_evictions}
