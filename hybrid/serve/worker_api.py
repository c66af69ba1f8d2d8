"""What the gateways ask of a worker besides generation (docs/design/replicas.md):

- `GET /server_info`, `/model_info` (and SGLang's older `/get_server_info`, `/get_model_info`): the SGLang Model
  Gateway reads the served model's name, type and architectures from them when it registers a worker;
- `GET /get_load`: the load its `power_of_two` policy balances, SGLang's shape (a list, one entry per data-parallel
  rank: requests, those waiting, tokens they hold);
- `POST /v1/chat/completions/render`, `/v1/completions/render`: vLLM's render routes, which vllm-router calls before
  each request to route by token ids: the request's prompt after the chat template and tokenisation, and its
  sampling parameters, as vLLM's `GenerateRequest` (one for chat; a list, one per prompt, for completions). Nothing
  is generated; the request is checked as the generation route checks it.

`/health` and `/v1/models` are the app's own (hybrid/serve/app.py)."""
from __future__ import annotations

import uuid
from typing import Any, Optional

from fastapi import APIRouter
from fastapi.responses import JSONResponse

import hybrid
from hybrid.engine.requests import SamplingParams
from hybrid.serve import completions
from hybrid.serve.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from hybrid.serve.service import Service

ARCHITECTURE = "DeepseekV3ForCausalLM"  # DeepSeek-V3/R1's and Kimi-K2's (hybrid/model/args.py)
_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 503)}


def router(service: Service) -> APIRouter:
    r = APIRouter()

    @r.get("/server_info", responses=_ERRORS)
    @r.get("/get_server_info", include_in_schema=False)
    async def server_info() -> JSONResponse:
        """The served model and the server's limits, as SGLang names them."""
        plan = service.ready_engine().plan
        return JSONResponse({"served_model_name": service.model_name, "context_length": plan.kv.max_context,
                             "max_running_requests": plan.decode.batch_cap, "max_num_reqs": plan.kv.max_batch,
                             "dp_size": 1, "disable_radix_cache": not plan.kv.prefix_cache,
                             "page_size": plan.kv.block_tokens, "version": hybrid.__version__, "engine": "hybrid"})

    @r.get("/model_info", responses=_ERRORS)
    @r.get("/get_model_info", include_in_schema=False)
    async def model_info() -> JSONResponse:
        """The model's type and architectures (its config.json's), as SGLang names them."""
        engine = service.ready_engine()
        return JSONResponse({"model_path": service.model_name, "tokenizer_path": None, "is_generation": True,
                             "model_type": engine.model.args.model_type, "architectures": [ARCHITECTURE],
                             "weight_version": "default"})

    @r.get("/get_load", responses=_ERRORS)
    async def get_load() -> JSONResponse:
        """Requests running and waiting, and the tokens they hold (running: prompt and output; waiting: prompt)."""
        s = service.ready_engine().scheduler
        running, waiting = list(s.running), list(s.waiting)
        tokens = sum(q.position for q in running) + sum(len(q.prompt) for q in waiting)
        return JSONResponse([{"dp_rank": 0, "num_reqs": len(running) + len(waiting),
                              "num_waiting_reqs": len(waiting), "num_tokens": tokens}])

    @r.post("/v1/chat/completions/render", responses=_ERRORS)
    async def render_chat(body: ChatCompletionRequest) -> JSONResponse:
        """The chat request's prompt token ids (tools and template applied) and sampling parameters, as vLLM's
        GenerateRequest; nothing is generated."""
        turn, max_tokens, top = await completions.chat_turn(service, body)
        return JSONResponse(generate_request(service, turn.prompt, body, max_tokens, top))

    @r.post("/v1/completions/render", responses=_ERRORS)
    async def render_completion(body: CompletionRequest) -> JSONResponse:
        """Each prompt's token ids and the sampling parameters, as a list of vLLM's GenerateRequest."""
        prompts, _ = await completions.completion_prompts(service, body)
        return JSONResponse([generate_request(service, p, body, body.max_tokens or 16, body.logprobs)
                             for p in prompts])
    return r


def generate_request(service: Service, prompt: list[int], body, max_tokens: int,
                     logprobs: Optional[int]) -> dict[str, Any]:
    """vLLM's GenerateRequest of one prompt."""
    p = completions.sampling_params(body, max_tokens, logprobs)
    return {"request_id": uuid.uuid4().hex, "token_ids": list(prompt), "features": None,
            "sampling_params": vllm_sampling(p, body), "model": service.model_name, "stream": bool(body.stream),
            "stream_options": body.stream_options.model_dump() if body.stream_options else None,
            "cache_salt": None, "priority": 0, "kv_transfer_params": None}


def vllm_sampling(p: SamplingParams, body) -> dict[str, Any]:
    """The request's sampling as vLLM's SamplingParams fields."""
    return {"n": body.n or 1, "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty, "temperature": p.temperature, "top_p": p.top_p,
            "top_k": p.top_k, "min_p": p.min_p, "seed": p.seed, "stop": list(p.stop),
            "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos, "max_tokens": p.max_tokens,
            "logprobs": p.logprobs, "logit_bias": {str(t): b for t, b in p.logit_bias} or None,
            "skip_special_tokens": body.skip_special_tokens is not False,
            "include_stop_str_in_output": bool(body.no_stop_trim)}
