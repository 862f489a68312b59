"""A minimal OpenAI-compatible server for an autoregressive transformers checkpoint (the AR twin), written
only as a second engine for `unmask loadtest --compare` (docs/loadtest.md). Not a product: one request decodes
at a time (no batching), greedy or temperature sampling, one token per forward with transformers' KV cache.

    python bench/ar_twin_server.py --model bench/models/ar-twin --port 8001

Routes: GET /health, GET /v1/models, POST /v1/completions and /v1/chat/completions (prompt / messages,
max_tokens, temperature, stream, stream_options.include_usage, ignore_eos; the chat template of the
tokenizer). Streamed chunks carry each token's new text; usage counts token ids. A body that is not JSON, lacks its
prompt / messages or has a bad max_tokens is a 400, another model id a 404, each in OpenAI's error envelope."""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig


def build_app(model_dir: str, name: str) -> FastAPI:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    lock = asyncio.Lock()
    app = FastAPI()

    @torch.inference_mode()
    def step(ids: torch.Tensor, past, temperature: float, gen: torch.Generator):
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        logits = out.logits[0, -1].float()
        if temperature > 0:
            nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
        else:
            nxt = int(logits.argmax())
        return nxt, out.past_key_values

    async def decode(body: dict, chat: bool):
        """Yields (new text, finish_reason or None) per token; sets body['_usage']."""
        if chat:
            ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tok.encode(body["prompt"], add_special_tokens=False)
        max_tokens = int(body.get("max_tokens") or 16)
        ignore_eos, temperature = bool(body.get("ignore_eos")), float(body.get("temperature") or 0.0)
        gen = torch.Generator().manual_seed(int(body.get("seed") or 0))
        out: list[int] = []
        text = ""
        async with lock:
            past, feed = None, torch.tensor([ids])
            finish = "length"
            while len(out) < max_tokens:
                nxt, past = await asyncio.to_thread(step, feed, past, temperature, gen)
                out.append(nxt)
                feed = torch.tensor([[nxt]])
                if nxt in stops and not ignore_eos:
                    finish = "stop"
                    break
                now = tok.decode(out, skip_special_tokens=True)
                delta, text = now[len(text):], now
                yield delta, None
            yield "", finish
        body["_usage"] = {"prompt_tokens": len(ids), "completion_tokens": len(out),
                          "total_tokens": len(ids) + len(out)}

    def refuse(status: int, message: str, param: str | None, code: str | None) -> JSONResponse:
        """OpenAI's error envelope, so that a load tester counts the failure by its status."""
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                       "code": code}}, status_code=status)

    async def complete(request: Request, chat: bool):
        try:
            body = await request.json()
        except ValueError:
            return refuse(400, "the body is not JSON", None, None)
        if not isinstance(body, dict):
            return refuse(400, "the body is not a JSON object", None, None)
        if body.get("model") not in (None, name):
            return refuse(404, f"the model {body['model']!r} does not exist (this server has {name!r})", "model",
                          "model_not_found")
        field = "messages" if chat else "prompt"
        if not isinstance(body.get(field), list if chat else str) or not body[field]:
            return refuse(400, f"{field!r} is required", field, None)
        if not isinstance(body.get("max_tokens", 16), int) or body.get("max_tokens", 16) < 1:
            return refuse(400, "'max_tokens' must be a positive integer", "max_tokens", None)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish, stream: bool) -> dict:
            if not chat:
                return {"index": 0, "text": text, "finish_reason": finish}
            key = "delta" if stream else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}

        if not body.get("stream"):
            pieces, finish = [], None
            async for text, finish in decode(body, chat):
                pieces.append(text)
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": name,
                                 "choices": [choice("".join(pieces), finish, False)], "usage": body["_usage"]})

        async def events():
            head = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": name}
            async for text, finish in decode(body, chat):
                yield f"data: {json.dumps({**head, 'choices': [choice(text, finish, True)]})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': body['_usage']})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "bench"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bench/models/ar-twin")
    p.add_argument("--served-model-name", default="ar-twin")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    uvicorn.run(build_app(args.model, args.served_model_name), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
