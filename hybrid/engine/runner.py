"""The model runner: runs the engine's prefill and decode on the placed model and owns the KV cache.

Prefill: a prompt's range into its KV slot, in the step's chunks, by stream-loading (through `long_prefill`, in SLP
chunks of plan.prefill.slp_chunk_tokens), or on both devices with the prefill peer. Decode: one step for the decoding
requests through the plan's `Decoder` (hybrid/engine/decoder.py), as two micro-batches under plan.decode.dual_batch,
half a step apart where the decoder staggers (hybrid/engine/staggered.py). Results go back to the loop: logits from a
prefill, each batch's logits or failure to the loop's `Take` from a decode step."""
from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

import torch

from hybrid.engine.decoder import DecodeFn, Decoder, Eager, Part, as_decoder
from hybrid.engine.peer_link import PrefillPeer
from hybrid.plan.plan import Plan
from hybrid.engine.requests import Request
from hybrid.engine.scheduler import Chunk
from hybrid.engine.staggered import Ahead, Stagger, Take, micro_batches
from hybrid.kv.manager import KVManager, host_blocks
from hybrid.model.kv_cache import KVCache
from hybrid.model.transformer import Transformer
from hybrid.placement.staging import Staging

if TYPE_CHECKING:
    from hybrid.engine.cuda_graphs import GraphedDecode


class ModelRunner:
    def __init__(self, model: Transformer, plan: Plan, cache: Optional[KVCache] = None,
                 decode: Optional[Decoder | DecodeFn] = None,
                 long_prefill: Optional[Callable[..., ContextManager]] = None,
                 after_prefill: Optional[Callable[[], None]] = None, staging: Optional[Staging] = None):
        """cache: the paged KV cache (default: kv.max_batch x kv.max_context on the plan's device), its blocks handed
        out by the runner's KV manager (`kv`, hybrid/kv/manager.py); decode: the plan's decode
        strategy (default: eager); long_prefill(tokens): the context in which a prompt's chunk of that many tokens is
        prefilled by stream-loading (None: nothing streams here); after_prefill: called once a prompt is prefilled
        (`refresh`); staging: the CPU experts' hand-off buffers, for graphed decoders made on demand
        (`decoder_for`)."""
        self.model, self.plan, self.device = model, plan, torch.device(plan.device)
        k = plan.kv
        self.cache = cache or model.new_cache(k.max_batch, k.max_context, self.device, k.block_tokens)
        self.kv = KVManager(self.cache, k.prefix_cache, host_blocks(k.host_cache_gb, self.cache))
        self.long_prefill, self.after_prefill, self.staging = long_prefill, after_prefill, staging
        self.refresh_due = False  # after_prefill put off until no step runs ahead
        self.eager = Eager(model, self.cache)
        self.decoder = as_decoder(decode) if decode is not None else self.eager
        graphed = decode is not None and plan.decode.cuda_graphs != "off"
        self.graphed: dict[str, "GraphedDecode"] = {plan.decode.cuda_graphs: self.decoder} if graphed else {}
        self.stagger = Stagger(self.decoder, self.inputs)

    # -- prefill ----------------------------------------------------------------------------------------------
    def prefill_chunk(self, chunk: Chunk, peer: Optional[PrefillPeer] = None) -> torch.Tensor:
        """A scheduled chunk's prefill: the last token's logits. With `peer`, on both devices (this process is rank
        0 of the two-rank prefill)."""
        req = chunk.request
        self.kv.reserve(req.slot, chunk.end)
        if peer is not None:
            return peer.together(self.model, self.cache, req.prompt[chunk.start:chunk.end], req.slot, chunk.start,
                                 self.plan.prefill, self.plan.gpu.memory_budget_gb)
        return self.prefill(req.prompt, chunk.start, chunk.end, req.slot, chunk.streamed)[0]

    def prefill(self, prompt: list[int], start: int, end: int, slot: int, streamed: bool,
                cancelled: Optional[threading.Event] = None, **stream) -> tuple[torch.Tensor, list]:
        """prompt[start:end] into `slot` (the positions before it already there): the last token's logits, and the
        statistics of each stream-loading pass it took (one per SLP chunk). `cancelled`: set, no further chunk
        starts (the logits are then None); `stream` (ring_len, group, gemm, throttle) goes to long_prefill."""
        if not streamed or self.long_prefill is None:  # nothing to stream with (a CPU whose peer is gone)
            return self.forward(prompt[start:end], start, slot), []
        pipes, step = [], self.plan.prefill.slp_chunk_tokens or (end - start)
        for at in range(start, end, step):
            if cancelled is not None and cancelled.is_set():
                return None, pipes
            stop = min(end, at + step)
            with self.long_prefill(stop - at, cancel=cancelled, **stream) as pipe:
                logits = self.forward(prompt[at:stop], at, slot, pipe.experts)
            pipes.append(pipe.stats())  # not the pipeline: its ring and buffers go back before the next chunk
        return logits, pipes

    def streamed(self, tokens: int, asked: Optional[bool] = None) -> bool:
        """Whether a prompt of `tokens` tokens is stream-loaded: as asked, else as the scheduler would (longer than
        plan.prefill.slp_cutoff_tokens where stream-loading applies)."""
        if asked is None:
            return self.long_prefill is not None and tokens > self.plan.prefill.slp_cutoff_tokens
        if asked and self.long_prefill is None:
            raise RuntimeError("stream-loading prefill needs a GPU and policy.cpu.moe_backend=native")
        return asked

    def forward(self, tokens: list[int], start: int, slot: int, experts=None) -> torch.Tensor:
        """Prefill of tokens at positions start.. into `slot` (`experts`: a stream-loading prefill's routed
        experts, by layer): the last token's logits."""
        dev, end = self.device, start + len(tokens)
        logits = self.model(torch.tensor([tokens], device=dev), torch.arange(start, end, device=dev)[None],
                            self.cache, torch.tensor([slot], device=dev), last_only=True, kv_len=end,
                            experts=experts)
        return logits[0, -1]

    def refresh(self) -> None:
        """after_prefill (e.g. moving the hottest experts in): a failure there warns and the requests go on. Not
        while a micro-batch's step runs ahead (it reads the hot experts): then `refresh_due`, for the loop to call
        again once it has collected that step."""
        if self.after_prefill is None:
            return
        self.refresh_due = self.ahead is not None
        if self.refresh_due:
            return
        try:
            self.after_prefill()
        except Exception as e:  # noqa: BLE001 - an optimisation failed, not a request
            warnings.warn(f"after a prefill: {type(e).__name__}: {e} (the engine goes on without it)")

    def admit(self, req: Request) -> None:
        """A request took a slot: the prompt's cached prefix is its prefilled part."""
        req.prefilled = self.kv.admit(req.slot, req.prompt)

    def prefilled(self, req: Request, end: int) -> None:
        """The prompt's positions < end are in the cache: its full blocks are shared from now on."""
        self.kv.publish(req.slot, req.prompt, end)

    def release(self, req: Request) -> None:
        """The request ended: its blocks go back (those written through stay cached)."""
        written = req.prefilled if req.prefilled < len(req.prompt) else req.position - 1
        self.kv.release(req.slot, req.prompt + req.output, written)

    # -- decode -----------------------------------------------------------------------------------------------
    def decode(self, live: list[Request], take: Take, capture: bool, busy: Callable[[], bool]) -> None:
        """One decode step for `live`; each batch's logits, or the error that fails it, to `take`. capture: no
        graph capture while another thread uses the GPU; busy(): requests come or go (nothing launched ahead)."""
        groups = micro_batches(live) if self.plan.decode.dual_batch else [live]
        if len(groups) == 2 and self.plan.decode.dual_stagger and self.decoder.staggers:
            live = self.stagger.step(groups, take, capture, busy)
            if not live:
                return
            groups = micro_batches(live)
        try:
            parts = [self.inputs(g) for g in groups]
            if len(parts) == 2:  # overlapped where the decoder can: one's GPU work beside the other's CPU experts
                outs = self.decoder.dual(parts, capture=capture)
            else:
                outs = [self.decoder(*parts[0], capture=capture)]
            logits = torch.cat(outs) if len(outs) > 1 else outs[0]
        except Exception as e:  # the batch's requests fail together; the engine goes on
            take(live, e)
            return
        take(live, logits)

    @property
    def ahead(self) -> Optional[Ahead]:
        """The micro-batch step launched ahead (staggered dual-batch decode), if any."""
        return self.stagger.ahead

    def drain(self, take: Take, keep: Optional[list[list[Request]]] = None) -> list[int]:
        return self.stagger.drain(take, keep)

    def inputs(self, reqs: list[Request]) -> Part:
        """A decode step's (tokens_B1, pos_B1, slots_B, kv_len) for these requests: each one's last token at its
        position."""
        positions = [r.position - 1 for r in reqs]
        for r, p in zip(reqs, positions):
            self.kv.reserve(r.slot, p + 1)
        # one host-to-device copy for the three (each copy may wait behind a prefill's expert copies beside decode)
        both = torch.tensor([[r.output[-1], p, r.slot] for r, p in zip(reqs, positions)], device=self.device)
        return both[:, 0:1].contiguous(), both[:, 1:2].contiguous(), both[:, 2].contiguous(), max(positions) + 1

    def decoder_for(self, mode: str) -> Decoder:
        """Eager for `off`, else graphed decode in that mode (hostfn | segments; captured on first use)."""
        if mode == "off":
            return self.eager
        if mode not in self.graphed:
            from hybrid.engine.cuda_graphs import GraphedDecode  # GPU only

            self.graphed[mode] = GraphedDecode(self.model, self.cache, self.staging, mode, self.plan.kv.max_batch,
                                               self.plan.decode.cpu_join)
        return self.graphed[mode]
