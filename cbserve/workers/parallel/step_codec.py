"""A tensor-parallel step as one fixed-layout int64 tensor: what rank 0 broadcasts each step
instead of a pickled plan, and what the other ranks rebuild their attention metadata from.

Layout (all int64), `HEADER` slots then the payload:

    header   kind, length, sequence (the channel's: `groups.py`), then T tokens, R request rows,
             W block-table width, decode rows, flags, longest query, longest context, S kept
             logits rows, transfer ints, LoRA row slots (T or 0), LoRA copy ints
    payload  input ids [T] | positions [T] | slot mapping [T] | kept logits rows [S]
             | block table [R * W] | context lengths [R] | cumulative query lengths [R + 1] (only
             with kernel inputs)                               (these go to the device at once)
             | first position of each prefill row [R - decode rows]
             | KV transfers: (kind, n, n device pages, n host pages) each
             | LoRA: each row's adapter slot [T] (only when a row uses one) | (lora id, slot) copies

Rank 0 encodes from the host tensors its runner built (`host`: the list the runner copies to
its device), so no device tensor ever comes back to the host. A receiving rank copies the first
part to its device in one call and derives the rest (prefill chunks, cumulative query lengths)
on the host, as rank 0's runner did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbserve.kernels.attention_backends import KernelBackend
from cbserve.kernels.paged_attention import AttentionMetadata, KernelInputs, PrefillChunk
from cbserve.scheduler.host_pages import KVTransfer
from cbserve.workers.parallel.groups import HEADER

# Header slots 0-2 are the channel's (kind, length, sequence: groups.py); the step's own follow.
TOKENS, ROWS, WIDTH, DECODES, FLAGS, MAX_Q, MAX_K, KEPT, TRANSFER_INTS, LORA_ROWS, LORA_COPY_INTS = range(3, 14)
FAST_DECODE, KERNEL_INPUTS, DECODE_ONLY, DECODE_KERNEL = 1, 2, 4, 8
TRANSFER_KINDS = ("offload", "restore")


def _transfer_ints(transfers: list[KVTransfer]) -> torch.Tensor:
    ints: list[int] = []
    for t in transfers:
        ints += [TRANSFER_KINDS.index(t.kind), len(t.device_blocks), *t.device_blocks, *t.host_blocks]
    return torch.tensor(ints, dtype=torch.int64)


def _flags(meta: AttentionMetadata) -> int:
    ki = meta.kernel_inputs
    return ((FAST_DECODE if meta.fast_decode else 0) | (KERNEL_INPUTS if ki is not None else 0)
            | (DECODE_ONLY if ki is not None and ki.decode_only else 0)
            | (DECODE_KERNEL if meta.decode_kernel is not None else 0))


@dataclass
class LoraStep:
    """A step's adapter rows as rank 0 prepared them (`LoraSlots.prepare`): each row's slot (None:
    no row uses an adapter) and the (lora id, slot) copies made for the step."""

    rows: torch.Tensor | None
    copies: list[tuple[int, int]]


def encode(host: list[torch.Tensor], meta: AttentionMetadata, transfers: list[KVTransfer],
           lora: LoraStep | None = None) -> torch.Tensor:
    """The step tensor (header slots 0-2 left for the channel). `host`: the runner's host inputs
    (ids, positions, slots, kept rows[, block table, lens, cu_seqlens]); `meta`: its metadata."""
    ids, positions, slots, kept = host[:4]
    nd, chunks = meta.num_decodes, meta.prefills
    if meta.kernel_inputs is not None:
        table = host[4]
    else:
        table = torch.cat(([meta.decode_block_table] if nd else []) + [c.block_table for c in chunks])
    firsts = torch.tensor([c.first_position for c in chunks], dtype=torch.int64)
    lens = torch.cat(([meta.decode_context_lens] if nd else [])
                     + [firsts + torch.tensor([c.num_queries for c in chunks], dtype=torch.int64)])
    moves = _transfer_ints(transfers)
    cu = host[6] if meta.kernel_inputs is not None else torch.empty(0, dtype=torch.int64)
    lora_rows = lora.rows.cpu() if lora is not None and lora.rows is not None else torch.empty(0, dtype=torch.int64)
    copies = torch.tensor([n for copy in lora.copies for n in copy] if lora is not None else [], dtype=torch.int64)
    parts = [ids, positions, slots, kept, table.reshape(-1), lens, cu, firsts, moves, lora_rows, copies]
    length = HEADER + sum(p.numel() for p in parts)
    flat = torch.empty(length, dtype=torch.int64)
    ki = meta.kernel_inputs
    flat[:HEADER] = torch.tensor([0, length, 0, ids.numel(), table.shape[0], table.shape[1], nd, _flags(meta),
                                  ki.max_seqlen_q if ki is not None else 0, ki.max_seqlen_k if ki is not None else 0,
                                  kept.numel(), moves.numel(), lora_rows.numel(), copies.numel(), 0, 0])
    torch.cat([p.reshape(-1).to(torch.int64) for p in parts], out=flat[HEADER:])
    return flat


def decode_transfers(ints: list[int]) -> list[KVTransfer]:
    transfers, i = [], 0
    while i < len(ints):
        kind, n = TRANSFER_KINDS[ints[i]], ints[i + 1]
        transfers.append(KVTransfer(kind, tuple(ints[i + 2 : i + 2 + n]), tuple(ints[i + 2 + n : i + 2 + 2 * n])))
        i += 2 + 2 * n
    return transfers


def _chunks(table: torch.Tensor, lens: list[int], firsts: list[int], nd: int, page_size: int) -> list[PrefillChunk]:
    chunks, q = [], nd
    for j, first in enumerate(firsts):
        n = lens[nd + j] - first
        chunks.append(PrefillChunk(q, q + n, first, table[nd + j : nd + j + 1], page_size))
        q += n
    return chunks


def decode(flat: torch.Tensor, device: torch.device, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
           page_size: int, kernels: KernelBackend | None) -> tuple[dict, list[KVTransfer], LoraStep]:
    """The forward kwargs (input ids, positions, metadata, kept logits rows), the KV transfers
    to run before the forward pass and the step's adapter rows, from a step tensor."""
    h = flat[:HEADER].tolist()
    t, r, w, nd, flags, s = h[TOKENS], h[ROWS], h[WIDTH], h[DECODES], h[FLAGS], h[KEPT]
    cu_len = r + 1 if flags & KERNEL_INPUTS else 0
    sizes = [t, t, t, s, r * w, r, cu_len]
    on_device = HEADER + sum(sizes)
    host = flat[HEADER:on_device]
    dev = host.to(device) if device.type != "cpu" else host  # one copy
    ids, positions, slots, kept, dev_table, dev_lens, dev_cu = dev.split(sizes)
    _, _, _, _, table, lens, _ = host.split(sizes)
    table = table.view(r, w)
    firsts = flat[on_device : on_device + r - nd].tolist()
    tail = on_device + r - nd
    transfers = decode_transfers(flat[tail : tail + h[TRANSFER_INTS]].tolist())
    tail += h[TRANSFER_INTS]
    lora_rows = flat[tail : tail + h[LORA_ROWS]] if h[LORA_ROWS] else None
    tail += h[LORA_ROWS]
    copies = flat[tail : tail + h[LORA_COPY_INTS]].tolist()
    lora = LoraStep(lora_rows, list(zip(copies[::2], copies[1::2])))
    kernel_inputs = None
    if flags & KERNEL_INPUTS:
        kernel_inputs = KernelInputs(kernels, dev_table.view(r, w), dev_lens.to(torch.int32), dev_cu.to(torch.int32),
                                     decode_only=bool(flags & DECODE_ONLY), max_seqlen_q=h[MAX_Q],
                                     max_seqlen_k=h[MAX_K])
    meta = AttentionMetadata(
        k_caches=k_caches, v_caches=v_caches, slot_mapping=slots, page_size=page_size, num_decodes=nd,
        decode_block_table=table[:nd] if nd else None, decode_context_lens=lens[:nd] if nd else None,
        prefills=_chunks(table, lens.tolist(), firsts, nd, page_size), kernel_inputs=kernel_inputs,
        decode_kernel=kernels.decode if flags & DECODE_KERNEL else None, fast_decode=bool(flags & FAST_DECODE),
    )
    kwargs = {"input_ids": ids[None], "position_ids": positions[None], "logits_to_keep": kept, "cb_meta": meta,
              "use_cache": False}
    return kwargs, transfers, lora
