"""The fields the standard gateways (the SGLang Model Gateway, `sglang-router`; `vllm-router`) add to every request
they forward, as SGLang's and vLLM's extensions, and what each means here:

- `skip_special_tokens` (default true: special tokens dropped, the tool-call and reasoning markers kept) and
  `no_stop_trim` (default false: the stop string or stop token that ended the text is cut off): a choice asking for
  the other value has its text decoded here from its token ids (`Retext`) instead of taken from the engine;
- `separate_reasoning` (false: the reasoning stays in `content`, `<think>` and all), `stream_reasoning` (false: the
  reasoning streamed as one delta once it ends), `include_reasoning` (false: no `reasoning_content`): `Reasoning`;
- `continue_final_message`: the prompt ends inside the last (assistant) message (hybrid/serve/agent.py);
- `ignore_eos`: the engine's own;
- `return_hidden_states`: accepted false, refused true (400 naming it).

`RequestId` echoes the request's `X-Request-Id` (or a new id) in every response."""
from __future__ import annotations

import uuid
from typing import Optional

from hybrid.engine.outputs import _first_stop, _stop_prefix
from hybrid.engine.requests import FinishReason, RequestOutput
from hybrid.serve.parsers import Event, Text
from hybrid.serve.service import APIError

REQUEST_ID = "X-Request-Id"


def check(body) -> None:
    """Refuses the gateway fields' values the server cannot honour."""
    if getattr(body, "return_hidden_states", None):
        raise APIError(400, "return_hidden_states: this server does not return hidden states (send false or leave "
                            "it out)", param="return_hidden_states", code="unsupported_field")


def retexts(body, tokenizer, stop_ids: frozenset[int], n: int) -> Optional[list["Retext"]]:
    """A Retext per choice when the request asks for special tokens or untrimmed stops; None: the engine's text."""
    specials = getattr(body, "skip_special_tokens", True) is False
    keep_stop = bool(getattr(body, "no_stop_trim", False))
    if not (specials or keep_stop) or tokenizer is None:
        return None
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return [Retext(tokenizer, stops, stop_ids, specials, keep_stop) for _ in range(n)]


class Retext:
    """One choice's text decoded from its token ids: with special tokens (`specials`), and keeping the stop string or
    stop token that ended it (`keep_stop`: the text of every id generated). Text is handed out as the engine hands
    out its own: nothing that may still change (a partial character, the start of a stop string) before the end.
    Each output decodes the ids so far again: meant for the requests that ask for these."""

    def __init__(self, tokenizer, stops: tuple[str, ...], stop_ids: frozenset[int], specials: bool,
                 keep_stop: bool):
        self.tokenizer, self.stops, self.stop_ids = tokenizer, stops, stop_ids
        self.specials, self.keep_stop = specials, keep_stop
        self.ids: list[int] = []
        self.shown = 0
        self.ended = False  # a stop string found in this text: nothing more is shown

    def delta(self, out: RequestOutput) -> str:
        self.ids += out.new_token_ids
        if self.ended:
            return ""
        ids = self.ids
        if (out.finished and not self.keep_stop and out.finish_reason is FinishReason.stop and ids
                and ids[-1] in self.stop_ids):
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=not self.specials)
        if not self.keep_stop:
            cut = _first_stop(text, self.stops, max(0, self.shown - max(map(len, self.stops), default=0)))
            if cut is not None:
                text, self.ended = text[:cut], True
        if not (out.finished or self.ended):
            text = text.rstrip("\ufffd")
            if not self.keep_stop:
                text = text[:len(text) - _stop_prefix(text, self.stops)]
        delta = text[self.shown:] if len(text) > self.shown else ""
        self.shown = max(self.shown, len(text))
        return delta


class Reasoning:
    """One chat choice's reasoning as the request asks: left out (`include_reasoning` false), or held back and handed
    out whole once the reasoning ends or the output does (`stream_reasoning` false)."""

    def __init__(self, body):
        self.include = getattr(body, "include_reasoning", True) is not False
        self.stream = getattr(body, "stream_reasoning", True) is not False
        self.held: list[str] = []

    def __call__(self, events: list[Event], final: bool = False) -> list[Event]:
        out: list[Event] = []
        for e in events:
            if isinstance(e, Text) and e.kind == "reasoning":
                if self.include and self.stream:
                    out.append(e)
                elif self.include:
                    self.held.append(e.text)
                continue
            out += self._flush()
            out.append(e)
        return out + (self._flush() if final else [])

    def _flush(self) -> list[Event]:
        text, self.held = "".join(self.held), []
        return [Text("reasoning", text)] if text else []

    def message(self, msg: dict) -> dict:
        """The whole answer's assistant message, without its reasoning when not included."""
        if not self.include:
            msg.pop("reasoning_content", None)
        return msg


class RequestId:
    """ASGI middleware: every response carries X-Request-Id, the request's own (as the gateways forward it) or a new
    one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        rid = given or uuid.uuid4().hex.encode()

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid)]}
            await send(message)
        await self.app(scope, receive, tagged)
