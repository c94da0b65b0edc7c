"""The engine's LoRA adapters: every loaded adapter in host memory, and at most `max_loras` of them
resident in the adapted projections' slots (`kernels/lora.py`), least recently used evicted.

Each load gets a new integer id, never reused in this engine: requests carry it (`Request.lora_id`),
the prefix cache roots its hash chains on it (pages of one adapter are never another's, nor those
of an adapter unloaded and loaded again under the same name), and the scheduler admits requests of
at most `max_loras` adapters into the running set, so that one step's adapters are always resident
together. Before each pass, `prepare` makes the step's adapters resident (copying evicted ones
back from host memory) and sets each row's slot.

The slots' storage is made once per engine (`kernels/lora.py` has its layout): one pair of factor
tensors per projection, or per group of projections the lean forward fuses into one GEMM (q/k/v,
gate/up), each projection writing into its own view of them. `attach` wraps what the pass calls:
a fused group's one module when the weights were packed (fused), else each projection.

Under tensor parallelism (the model is a shard, `parallel/sharding.py`) adapters are read and kept
whole, checked against the whole model's shapes, and each rank copies its shard's slice of them
into its slots, split like their base layers: a column-parallel projection's lora_B by output rows,
a row-parallel one's lora_A by input columns (its delta then all-reduced, `kernels/lora.py`). Rank 0
alone decides residency: each step's row slots and the copies it made (`step_copies`) reach the
other ranks with the step, and the adapters they need before it (`sync`), where `apply` replays them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from cbserve.errors import InvalidRequestError
from cbserve.kernels import llama_forward, lora, quantized
from cbserve.workers import lora_adapter
from cbserve.workers.lora_adapter import LoraAdapter


def projections(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """The projections LoRA adapts, dense or on quantized blocks (the delta stays in the model's
    dtype, as llama.cpp applies adapters over quantized weights): model module name -> (parent
    module, attribute)."""
    found = {}
    for name, module in model.named_modules():
        parent, _, attribute = name.rpartition(".")
        if attribute in lora_adapter.PROJECTIONS and (type(module) is torch.nn.Linear
                                                      or isinstance(module, quantized.QuantizedLinear)):
            found[name] = (model.get_submodule(parent), attribute)
    return found


def quantized_groups(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, tuple[str, ...]]]:
    """(module, fused attribute, projections) of the q/k/v and gate/up groups that quantization
    already fused into one module (`quantized.fuse_projections`): the lean forward calls those."""
    return [(module, fused, parts) for module in model.modules() for fused, parts in llama_forward.FUSED.items()
            if isinstance(module._modules.get(fused), quantized.QuantizedLinear)]


@dataclass
class Factors:
    """One projection's slots: views into its (or its fused group's) `a` and `b_t`."""

    a: torch.Tensor  # [max_loras * r, in]
    b_t: torch.Tensor  # [max_loras * r, out]


@dataclass
class Group:
    """Projections of one module that share their input and may run as one fused GEMM."""

    parent: torch.nn.Module
    fused: str | None  # the fused module's attribute (`llama_forward.FUSED`); None: never fused
    parts: tuple[str, ...]
    names: tuple[str, ...]  # the parts' model module names
    a: torch.Tensor  # [len(parts) * max_loras * r, in]
    b_t: torch.Tensor  # [max_loras * r, sum of the parts' outputs]
    part_ends: list[int]


@dataclass(frozen=True)
class ShardSlice:
    """How a tensor-parallel rank takes its part of one projection's factors."""

    row_parallel: bool  # split by input columns (lora_A's); else by output rows (lora_B's)
    rank: int
    world: int

    def whole(self, fan_in: int, fan_out: int) -> tuple[int, int]:
        """The whole model's (in, out) of a shard's projection."""
        return (fan_in * self.world, fan_out) if self.row_parallel else (fan_in, fan_out * self.world)

    def take(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (lora_A [r, in / world] or whole, lora_B [out / world, r] or whole)."""
        if self.row_parallel:
            n = a.shape[1] // self.world
            return a[:, self.rank * n:(self.rank + 1) * n], b
        n = b.shape[0] // self.world
        return a, b[self.rank * n:(self.rank + 1) * n]


def shard_slices(model: torch.nn.Module, names: list[str]) -> dict[str, ShardSlice]:
    """For a tensor-parallel shard, each adapted projection's slice (empty for a whole model)."""
    from cbserve.workers.parallel import sharding  # torch.distributed only when used

    spec = sharding.shard_spec(model)
    if not sharding.is_shard(model):
        return {}
    rules = sharding.tp_rules(model)
    slices = {}
    for name in names:
        rule = rules.get(name)
        if rule not in (sharding.COLWISE, sharding.ROWWISE):
            raise ValueError(f"enable_lora with tp_size={spec.world}: {name} is {rule or 'not split'} in the model's "
                             "tensor-parallel plan; adapters are served on split projections only")
        slices[name] = ShardSlice(rule == sharding.ROWWISE, spec.rank, spec.world)
    return slices


class LoraSlots:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int,
                 reduce_group: object | None = None) -> None:
        """`reduce_group`: the tensor-parallel data group when `model` is a shard."""
        self.max_loras, self.max_rank = max_loras, max_rank
        self.batch = lora.LoraBatch(max_loras, max_rank)
        places = projections(model)
        if not places:
            raise ValueError(f"enable_lora: {type(model).__name__} has no nn.Linear projections named "
                             f"{', '.join(lora_adapter.PROJECTIONS)} for adapters to adapt")
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.slices = shard_slices(model, list(places))
        self.reduce_group = reduce_group
        self.groups = self._groups(model, places)
        self.factors: dict[str, Factors] = {}
        for g in self.groups:
            width, begin = max_loras * max_rank, 0
            for p, (name, end) in enumerate(zip(g.names, g.part_ends, strict=True)):
                self.factors[name] = Factors(g.a[p * width:(p + 1) * width], g.b_t[:, begin:end])
                begin = end
        self.shapes = {name: (f.a.shape[1], f.b_t.shape[1]) for name, f in self.factors.items()}
        for name, part in self.slices.items():  # adapters are read whole, then sliced
            self.shapes[name] = part.whole(*self.shapes[name])
        self._wrapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
        self.adapters: dict[str, LoraAdapter] = {}  # by name, in host memory
        self.ids: dict[str, int] = {}
        self._by_id: dict[int, LoraAdapter] = {}
        self._next_id = 1
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recently used first
        self._lock = threading.Lock()  # loads from callers' threads, residency on the engine's
        self.num_loads = self.num_evictions = 0  # copies into slots, and slots taken from an adapter
        self.step_copies: list[tuple[int, int]] = []  # the last prepared step's (lora id, slot) copies
        self._synced: set[int] = set()  # tensor parallelism: adapters the other ranks hold

    def _groups(self, model: torch.nn.Module, places: dict[str, tuple[torch.nn.Module, str]]) -> list[Group]:
        """The fusable groups (`llama_forward.fused_groups`), and every other projection alone."""
        names = {id(module): name for name, module in model.named_modules()}
        width = self.max_loras * self.max_rank
        groups, grouped = [], set()
        specs = [*llama_forward.fused_groups(model), *quantized_groups(model),
                 *((parent, None, (attr,)) for parent, attr in places.values())]
        for parent, fused, parts in specs:
            full = tuple(f"{names[id(parent)]}.{part}" for part in parts)
            if set(full) & grouped or not set(full) <= places.keys():
                continue  # a part of a group already, or a group with a projection LoRA does not adapt
            grouped.update(full)
            linears = [getattr(parent, part) for part in parts]
            ends = [sum(m.out_features for m in linears[:i + 1]) for i in range(len(linears))]
            a = torch.zeros(len(parts) * width, linears[0].in_features, dtype=self.dtype, device=self.device)
            b_t = torch.zeros(width, ends[-1], dtype=self.dtype, device=self.device)
            groups.append(Group(parent, fused, parts, full, a, b_t, ends))
        return groups

    # -- the model -------------------------------------------------------------------------------

    def attach(self) -> None:
        """Wrap what the forward pass calls (after packing): a group's fused module where the
        weights were packed into one, else each of its projections."""
        for g in self.groups:
            fused = g.parent._modules.get(g.fused) if g.fused else None
            if fused is not None:
                self._wrap(g.parent, g.fused, lora.LoraLinear(fused, g.a, g.b_t, g.part_ends, self.batch))
                continue
            for part, name in zip(g.parts, g.names, strict=True):
                f = self.factors[name]
                base = getattr(g.parent, part)
                row_parallel = name in self.slices and self.slices[name].row_parallel
                self._wrap(g.parent, part, lora.LoraLinear(base, f.a, f.b_t, [f.b_t.shape[1]], self.batch,
                                                           self.reduce_group if row_parallel else None))

    def _wrap(self, parent: torch.nn.Module, attribute: str, layer: torch.nn.Module) -> None:
        self._wrapped.append((parent, attribute, layer.base))
        setattr(parent, attribute, layer)

    def detach(self) -> None:
        """Give the model what `attach` wrapped back (before unpacking)."""
        for parent, attribute, base in reversed(self._wrapped):
            setattr(parent, attribute, base)
        self._wrapped.clear()

    # -- loading -----------------------------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> int:
        """Read a PEFT adapter folder into host memory under `name`; returns its id."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name", f"an adapter name must be a non-empty string, got {name!r}")
        if name in self.ids:
            raise InvalidRequestError("lora_name", f"an adapter named {name!r} is already loaded (unload it first)")
        try:
            adapter = lora_adapter.read(path, name, self.max_rank, self.shapes, self.dtype)
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
        self.step_copies = []
        used = {lora_id for lora_id, _ in rows if lora_id is not None}
        if not used:
            self.batch.rows = None
            return
        with self._lock:
            slots = self._make_resident(used)
        row_slots = torch.cat([torch.full((n,), -1 if i is None else slots[i], dtype=torch.long) for i, n in rows])
        self.batch.rows = row_slots.to(self.device)

    def end_step(self) -> None:
        self.batch.rows = None

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
            self.step_copies.append((lora_id, slot))
            self.num_loads += 1
        return {lora_id: self.resident[lora_id] for lora_id in used}

    def _copy_in(self, adapter: LoraAdapter, slot: int) -> None:
        """The adapter's factors into `slot`'s columns of every projection (zeros where it has none,
        and past its rank)."""
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        r = adapter.rank
        for name, f in self.factors.items():
            f.a[cols].zero_()
            f.b_t[cols].zero_()
            factors = adapter.weights.get(name)  # (A [r, in], B [out, r])
            if factors is not None:
                if name in self.slices:
                    factors = self.slices[name].take(*factors)
                f.a[cols][:r].copy_(factors[0])
                f.b_t[cols][:r].copy_(factors[1].T)

    # -- tensor parallelism: rank 0 tells, the other ranks replay -----------------------------------

    def sync(self) -> dict | None:
        """Rank 0, before sending a prepared step: the adapters its copies need that the other ranks
        do not hold yet, and those unloaded since (None when there is nothing to tell)."""
        with self._lock:
            new = {i: self._by_id[i] for i, _ in self.step_copies if i not in self._synced}
            gone = [i for i in self._synced if i not in self._by_id]
        if not new and not gone:
            return None
        self._synced.difference_update(gone)
        self._synced.update(new)
        return {"adapters": new, "forget": gone}

    def receive(self, message: dict) -> None:
        """Another rank: keep what rank 0's `sync` sent."""
        for lora_id in message["forget"]:
            self._by_id.pop(lora_id, None)
        self._by_id.update(message["adapters"])

    def apply(self, rows: torch.Tensor | None, copies: list[tuple[int, int]]) -> None:
        """Another rank: rank 0's copies for this step, then its row slots (None: no adapter rows)."""
        for lora_id, slot in copies:
            self._copy_in(self._by_id[lora_id], slot)
        self.batch.rows = None if rows is None else rows.to(self.device)

    def stats(self) -> dict[str, int]:
        return {"lora_loaded": len(self.adapters), "lora_resident": len(self.resident),
                "lora_slot_loads": self.num_loads, "lora_evictions": self.num_evictions}
