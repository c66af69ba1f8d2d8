"""The serving engine with its prefill peer (hybrid/parallel/peer.py), on the CPU stand-in: build(cpu_peer=True)
starts the peer process on the CPU, joined to the engine's process over gloo, and prompts longer than
policy.prefill.slp_cutoff_tokens take the two-device paths — both ranks when nothing decodes, the peer alone while
another request decodes. Each path gives the one-process engine's greedy tokens and KV cache; a peer killed under a
request fails that request with a clear error and the engine goes on on one device; close() ends the peer."""
from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from hybrid.config.compose import compose, to_settings
from hybrid.engine.build import build
from hybrid.engine.requests import FinishReason, SamplingParams
from hybrid.parallel.peer import Peer
from hybrid.parallel.peer_commands import Knobs, alone
from hybrid.prefill.slp import StreamLoader

CUTOFF = 16  # prompts longer than this take the two-device paths
ATOL = 1e-4  # float32; two ranks against one differ by ~1e-5 (tests/parallel/test_two_process.py)
OVERRIDES = ["+hw=cpu_only", "model.dtype=float32", "policy.kv.max_batch=3", "policy.kv.max_context=96",
             "policy.decode.batch_cap=3", "policy.prefill.chunk_tokens=8",
             f"policy.prefill.slp_cutoff_tokens={CUTOFF}", "policy.cpu.threads=1"]


def _settings(*more: str):
    return to_settings(compose(OVERRIDES + list(more)))


@pytest.fixture(scope="module")
def one():
    """The one-process engine: every prompt in chunks on the CPU."""
    s = _settings()
    engine = build(s, s.hw, progress=False)
    assert engine.peer is None and engine.scheduler.long_cutoff is None
    return engine


@pytest.fixture
def two():
    """An engine with a peer on the CPU; closed after the test (one process group per process)."""
    engine = None

    def make(*more: str):
        nonlocal engine
        s = _settings(*more)
        engine = build(s, s.hw, progress=False, cpu_peer=True)
        return engine

    yield make
    if engine is not None:
        engine.close()
    assert not dist.is_initialized(), "the engine's process left the group"


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _solo(engine, prompt, n: int) -> list[int]:
    return engine.generate([prompt], _greedy(n))[0].output_ids


def _slot_rows(engine, slot: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [layer.rows(slot, n) for layer in engine.cache.layers]


def _reference_rows(one, prompt) -> list[tuple[torch.Tensor, torch.Tensor]]:
    one.prefill(prompt, slot=2, streamed=False)
    rows = _slot_rows(one, 2, len(prompt))
    return rows


def _same_rows(got, want, what: str) -> None:
    for layer, ((kv, pe), (kv_ref, pe_ref)) in enumerate(zip(got, want)):
        err = max((kv - kv_ref).abs().max().item(), (pe - pe_ref).abs().max().item())
        assert err <= ATOL, f"{what}: layer {layer}'s latents differ by {err:.2e}"


def _first_token(engine, rid: int, limit: int = 500) -> list:
    """Steps until request rid has its first token; the outputs of every request meanwhile, by id."""
    outs: dict[int, list] = {}
    for _ in range(limit):
        for o in engine.step():
            outs.setdefault(o.id, []).append(o)
        if any(o.new_token_ids or o.finished for o in outs.get(rid, [])):
            return outs
    raise AssertionError(f"request {rid} got no token in {limit} steps")


def _finish(engine, outs: dict, limit: int = 2000) -> dict:
    for _ in range(limit):
        if not engine.has_work():
            return outs
        for o in engine.step():
            outs.setdefault(o.id, []).append(o)
    raise AssertionError("requests left unfinished")


def _tokens(outs, rid) -> list[int]:
    return [t for o in outs[rid] for t in o.new_token_ids]


def test_a_long_prompt_with_nothing_decoding_is_prefilled_by_both_ranks(one, two):
    engine = two()
    assert isinstance(engine.peer, Peer) and engine.plan.prefill.gpus == 2 and engine.scheduler.long_cutoff == CUTOFF
    prompt = _prompt(41, 2)  # odd: the ranks' halves differ by one
    rid = engine.add_request(prompt, _greedy(6))
    outs = _first_token(engine, rid)
    assert engine.peer.served == {"together": 1, "alone": 0}
    slot = engine.request(rid).slot
    _same_rows(_slot_rows(engine, slot, len(prompt)), _reference_rows(one, prompt), "prefilled together")
    outs = _finish(engine, outs)
    assert _tokens(outs, rid) == _solo(one, prompt, 6)
    assert outs[rid][-1].finish_reason is FinishReason.length
    short = _prompt(CUTOFF, 3)  # at the cutoff: chunks on the engine's own device
    assert _solo(engine, short, 4) == _solo(one, short, 4) and engine.peer.served["together"] == 1


def test_a_long_prompt_while_another_decodes_is_prefilled_by_the_peer_alone(one, two):
    engine = two("policy.prefill.ep=ep")
    short, long_ = _prompt(10, 1), _prompt(40, 2)
    a = engine.add_request(short, _greedy(30))
    outs = _first_token(engine, a)
    b = engine.add_request(long_, _greedy(5))
    for o in engine.step():  # b goes to the peer; a decodes meanwhile
        outs.setdefault(o.id, []).append(o)
    assert engine.beside.chunk.request.id == b
    more = _first_token(engine, b)
    for k, v in more.items():
        outs.setdefault(k, []).extend(v)
    assert engine.peer.served == {"together": 0, "alone": 1}
    _same_rows(_slot_rows(engine, engine.request(b).slot, len(long_)), _reference_rows(one, long_),
               "prefilled by the peer alone")
    outs = _finish(engine, outs)
    assert _tokens(outs, a) == _solo(one, short, 30), "the decoding request changed by the peer's prefill"
    assert _tokens(outs, b) == _solo(one, long_, 5)


@pytest.mark.parametrize("path", ["together", "alone"])
def test_the_streamed_paths_of_a_gpu_give_a_single_process_streamed_prefills_cache(one, two, path):
    """What the ranks run on GPUs — each streaming its share (or the peer all) of the experts through a ring — on
    the CPU stand-in, against one process's stream-loading prefill (the CPU kernels round activations to BF16, the
    streamed experts do not: the reference must stream too)."""
    knobs = Knobs(ring_len=3, stream=True)
    engine = two("policy.prefill.ring_len=3")
    engine.peer.stream = True
    assert Knobs.of(engine.plan.prefill, engine.plan.gpu.memory_budget_gb, engine.peer.stream) == knobs
    prompt = _prompt(37, 4)
    if path == "alone":
        a = engine.add_request(_prompt(10, 1), _greedy(40))
        _first_token(engine, a)
    rid = engine.add_request(prompt, _greedy(2))
    _first_token(engine, rid)
    assert engine.peer.served[path] == 1
    cache = one.model.new_cache(1, 96)
    logits = alone(one.model, torch.device("cpu"), prompt, cache, 0, StreamLoader(), knobs)
    ref = [layer.rows(0, len(prompt)) for layer in cache.layers]
    _same_rows(_slot_rows(engine, engine.request(rid).slot, len(prompt)), ref, f"streamed, {path}")
    assert engine.request(rid).output[0] == int(logits.argmax())


def test_aborting_a_prompt_on_the_peer_frees_its_slot_and_the_peer_serves_on(one, two):
    engine = two()
    short, long_ = _prompt(10, 1), _prompt(40, 2)
    a = engine.add_request(short, _greedy(12))
    outs = _first_token(engine, a)
    b = engine.add_request(long_, _greedy(5))
    for o in engine.step():
        outs.setdefault(o.id, []).append(o)
    assert engine.beside.chunk.request.id == b
    engine.abort(b)
    outs = _finish(engine, outs)
    assert outs[b][-1].finish_reason is FinishReason.abort and not _tokens(outs, b)
    assert _tokens(outs, a) == _solo(one, short, 12)
    assert _solo(engine, long_, 3) == _solo(one, long_, 3) and engine.peer.served["together"] == 1


def _kill_after(monkeypatch, command: str) -> None:
    """The peer is killed right after rank 0 hands it `command`: it dies holding the request."""
    real = Peer._send

    def send(self, cmd, *args):
        real(self, cmd, *args)
        if cmd == command:
            os.kill(self.pid, signal.SIGKILL)

    monkeypatch.setattr(Peer, "_send", send)


@pytest.mark.parametrize("command", ["together", "alone"])
def test_a_killed_peer_fails_its_request_and_the_engine_goes_on(one, two, monkeypatch, command):
    engine = two()
    _kill_after(monkeypatch, command)
    short, long_ = _prompt(10, 1), _prompt(40, 2)
    outs: dict = {}
    if command == "alone":  # something decodes: the long prompt goes to the peer alone
        a = engine.add_request(short, _greedy(20))
        outs = _first_token(engine, a)
    b = engine.add_request(long_, _greedy(5))
    more = _first_token(engine, b, limit=200)
    for k, v in more.items():
        outs.setdefault(k, []).extend(v)
    last = outs[b][-1]
    assert last.finished and last.finish_reason is FinishReason.error
    assert "prefill peer" in last.error and "died" in last.error, last.error
    with pytest.warns(UserWarning, match="prefill peer is gone"):
        c = engine.add_request(long_, _greedy(5))
        outs = _finish(engine, outs)
    assert engine.peer is None and engine.scheduler.long_cutoff is None, "on one device from now on"
    assert _tokens(outs, c) == _solo(one, long_, 5)
    if command == "alone":
        assert _tokens(outs, a) == _solo(one, short, 20), "the decoding request went on through it"


def test_close_ends_the_peer_process(two):
    engine = two()
    proc = engine.peer.process
    assert proc.is_alive() and dist.is_initialized()
    engine.close()
    assert not proc.is_alive() and proc.exitcode == 0, "the peer left on `stop`, not killed"
    assert engine.peer is None and not dist.is_initialized()
    prompt = _prompt(40, 2)
    assert len(_solo(engine, prompt, 3)) == 3, "steps may follow close(), on one device"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL between the engine and its peer)")
def test_two_gpus_serve_like_one(tmp_path):
    """On two GPUs: the peer on cuda:1 streams its share from the one pinned shared copy; tokens as one GPU's."""
    over = ["+hw=epyc2x_5090x2", "model.dtype=float32", "policy.kv.max_batch=3", "policy.kv.max_context=96",
            "policy.decode.batch_cap=3", f"policy.prefill.slp_cutoff_tokens={CUTOFF}", "policy.decode.cuda_graphs=off"]
    single = to_settings(compose(over + ["policy.prefill.gpus=1"]))
    ref = build(single, single.hw, progress=False)
    prompts = [_prompt(40, 2), _prompt(33, 5)]
    want = [_solo(ref, p, 5) for p in prompts]
    del ref
    s = to_settings(compose(over + ["policy.prefill.gpus=2"]))
    engine = build(s, s.hw, progress=False)
    try:
        assert engine.peer is not None and engine.peer.device == torch.device("cuda", 1)
        assert [_solo(engine, p, 5) for p in prompts] == want
        assert engine.peer.served["together"] == 2
    finally:
        engine.close()
