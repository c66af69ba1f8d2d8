"""What the gateways call on a worker (hybrid/serve/worker_api.py): vLLM's render routes (the prompt's token ids as
the generation route would build them, in vLLM's GenerateRequest shape) and SGLang's metadata and load routes."""
from __future__ import annotations

import httpx

from tests.serve.conftest import MODEL, PLAN, client_for, running, wait_idle
from tests.serve.test_gateway_fields import HI, VLLM_CHAT

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _post(srv, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers=headers, timeout=30)


def test_chat_render_is_the_prompt_the_chat_route_runs(server, client):
    body = {"model": MODEL, "messages": HI, "max_tokens": 5, "temperature": 0, "stop": ["x"], "seed": 3,
            **VLLM_CHAT}
    r = _post(server, "/v1/chat/completions/render", body)
    assert r.status_code == 200, r.text
    got = r.json()
    want = _post(server, "/tokenize", {"model": MODEL, "messages": HI}).json()["tokens"]
    assert got["token_ids"] == want and got["model"] == MODEL and got["stream"] is False
    sp = got["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["stop"], sp["seed"], sp["n"]) == (5, 0.0, ["x"], 3, 1)
    assert {"request_id", "features", "cache_salt", "priority", "kv_transfer_params"} <= set(got)
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0)
    assert chat.usage.prompt_tokens == len(want)
    with_tools = _post(server, "/v1/chat/completions/render", {**body, "tools": TOOLS}).json()["token_ids"]
    assert len(with_tools) > len(want)  # the tools are in the prompt
    wait_idle(server)


def test_completion_render_is_one_request_per_prompt(server, tiny_tok):
    r = _post(server, "/v1/completions/render", {"model": MODEL, "prompt": ["Once", "upon"], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert [g["token_ids"] for g in r.json()] == [tiny_tok.encode("Once"), tiny_tok.encode("upon")]
    ids = _post(server, "/v1/completions/render", {"model": MODEL, "prompt": [5, 6, 7]}).json()
    assert len(ids) == 1 and ids[0]["token_ids"] == [5, 6, 7] and ids[0]["sampling_params"]["max_tokens"] == 16


def test_render_checks_as_the_generation_routes_do(server):
    bad = [("/v1/chat/completions/render", {"model": MODEL, "messages": HI, "typo": 1}, 400),
           ("/v1/chat/completions/render", {"model": "other", "messages": HI}, 404),
           ("/v1/completions/render", {"model": MODEL, "prompt": [10 ** 6]}, 400),
           ("/v1/completions/render", {"model": MODEL, "prompt": "a", "return_hidden_states": True}, 400)]
    for path, body, status in bad:
        r = _post(server, path, body)
        assert r.status_code == status and "error" in r.json(), (path, r.text)


def test_metadata_and_load(server):
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()
    assert info["served_model_name"] == MODEL and info["context_length"] == PLAN.kv.max_context
    assert httpx.get(f"{server.url}/get_server_info", timeout=10).json() == info
    model = httpx.get(f"{server.url}/model_info", timeout=10).json()
    assert model["model_type"] == "deepseek_v3" and model["architectures"] == ["DeepseekV3ForCausalLM"]
    assert httpx.get(f"{server.url}/get_model_info", timeout=10).json() == model
    load = httpx.get(f"{server.url}/get_load", timeout=10).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_the_key_guards_them(tiny_model, tiny_tok):
    from hybrid.engine.engine import Engine
    from hybrid.serve import ServerConfig

    with running(Engine(tiny_model, PLAN, tiny_tok), ServerConfig(api_key="sk-1")) as srv:
        assert httpx.get(f"{srv.url}/server_info", timeout=10).status_code == 401
        ok = httpx.get(f"{srv.url}/server_info", headers={"Authorization": "Bearer sk-1"}, timeout=10)
        assert ok.status_code == 200
        r = _post(srv, "/v1/completions/render", {"model": MODEL, "prompt": "a"}, Authorization="Bearer sk-1")
        assert r.status_code == 200
        assert client_for(srv, "sk-1").models.list().data[0].id == MODEL
