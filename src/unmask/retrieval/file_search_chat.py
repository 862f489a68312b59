"""The `file_search` tool in /v1/chat/completions (an unmask extension: OpenAI's chat API has no such tool).

The same retrieval as in /v1/responses (file_search.py): the last user message is the query, the excerpts that
fit go into the system message (the first one, or a new one before the conversation). Chat has no item for the
search, so the answer reports it by its citations only: each choice's message gets `annotations`,
`file_citation`s of the files given to the model at the sentences they support (file_search.cite_spans) (OpenAI's chat messages carry `annotations` for its own web search);
streamed, they ride on each choice's last delta, the one with its `finish_reason`.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from pydantic import BaseModel

from unmask.retrieval import file_search
from unmask.server.protocol import ChatCompletionRequest, ChatMessage


async def chat(serving, req: ChatCompletionRequest, retrieval, is_disconnected=None):
    tools, search = file_search.split_tools(req.tools)
    if search is None:
        return await serving.chat(req, is_disconnected)
    base = req.model_copy(update={"tools": tools, "tool_choice": req.tool_choice if tools else None})
    await file_search.run(search, retrieval, [m.to_template() for m in req.messages])
    serving._validate(base)
    _, prompt = serving.chat_prompt(base)
    ctx = serving.spec.max_context
    reserve = req.max_completion_tokens or req.max_tokens or min(serving.cfg.default_max_tokens, ctx // 2)
    context = file_search.fit(search, lambda text: len(serving.tok.encode(text)), ctx - len(prompt) - reserve - 16)
    if context:
        messages = list(base.messages)
        if messages and messages[0].role in ("system", "developer"):
            first = messages[0].to_template()["content"]
            messages[0] = messages[0].model_copy(update={"content": f"{first}\n\n{context}" if first else context})
        else:
            messages.insert(0, ChatMessage(role="system", content=context))
        base = base.model_copy(update={"messages": messages})
    result = await serving.chat(base, is_disconnected)
    if isinstance(result, BaseModel):
        for choice in result.choices:
            choice.message.annotations = search.annotations(choice.message.content or "")
        return result
    return _annotated_stream(result, search)


async def _annotated_stream(frames: AsyncIterator[str], search: file_search.FileSearch) -> AsyncIterator[str]:
    """Add each choice's citations to its finishing delta (`index` counts the characters streamed before)."""
    texts: dict[int, str] = {}
    async with aclosing(frames):   # a client that leaves closes the inner stream too (its engine requests end)
        async for frame in frames:
            if not frame.startswith("data: {"):
                yield frame
                continue
            chunk = json.loads(frame[len("data: "):])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                texts[choice["index"]] = texts.get(choice["index"], "") + (delta.get("content") or "")
                if choice.get("finish_reason") is not None:
                    delta["annotations"] = search.annotations(texts[choice["index"]])
                    choice["delta"] = delta
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
