"""`POST /v1/embeddings`: OpenAI's embeddings API served from the decoder itself, as vLLM serves a
generative model's embeddings: the final-normed hidden states pooled (`--pooling-type`: the last
token's, or the mean) and L2-normalised (LLMEngine.embed). Each input runs on the engine thread
between two steps, through the paged cache in chunks; its blocks go back to the pool at once, so
embeddings take no lasting KV memory. `encoding_format` float or base64 (float32 bytes, as
OpenAI's clients decode them); `dimensions` is refused, as vLLM refuses it for a model without a
Matryoshka representation (a decoder's hidden state is not trained to be cut). vLLM's
`truncate_prompt_tokens` keeps each input's last k tokens, `normalize: false` skips the L2
normalisation and `add_special_tokens: false` the tokenizer's BOS."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, Field
from starlette.requests import Request

from kvserve.sampling_params import INT64_MAX, INT64_MIN
from kvserve.server.errors import APIError
from kvserve.server.prompts import Tokenization
from kvserve.server.protocol import OpenAIModel
from kvserve.server.serving import ServingContext, log_ignored_fields

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
RETRY_S = 0.02  # how often an embedding waiting for free KV blocks asks again


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM's: keep the last k (-1: max-model-len)
    # vLLM's; embeddings run between engine steps, never queued, so any priority the policy allows is met
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    add_special_tokens: bool = True  # vLLM's: a text input gets the tokenizer's special tokens (a BOS)
    normalize: bool | None = None  # vLLM's: false gives the pooled hidden state as it is (default: L2-normalised)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class EmbeddingServing:
    def __init__(self, ctx: ServingContext, tokens: Tokenization, hidden_size: int):
        self.ctx = ctx
        self.tokens = tokens
        self.hidden_size = hidden_size

    async def create(self, body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        self.ctx.check_model(body.model)
        self.ctx.priority(request, body.priority)
        log_ignored_fields(body.unknown_fields())
        if body.dimensions is not None:  # vLLM's text, and the size
            raise APIError(400, f"Model does not support matryoshka representation, changing output dimensions "
                                f"will lead to poor results (its embeddings have {self.hidden_size} dimensions).",
                           param="dimensions")
        prompts = await self.tokens.completion_prompts(body.input, truncating=body.truncate_prompt_tokens is not None,
                                                       param="input", add_special_tokens=body.add_special_tokens)
        for prompt in prompts:
            prompt.token_ids = self.ctx.truncated(prompt.token_ids, body.truncate_prompt_tokens)
        if len(prompts) > MAX_INPUTS:
            raise APIError(400, f"At most {MAX_INPUTS} inputs per request, got {len(prompts)}.", param="input")
        for prompt in prompts:  # ids given by the client index the embedding table
            self.tokens.check_token_ids(prompt.token_ids, "input")
        data = []
        for index, prompt in enumerate(prompts):
            vector = await self._embed(prompt.token_ids, body.normalize is not False)
            values = vector.numpy().astype(np.float32)
            encoded = (base64.b64encode(values.tobytes()).decode("ascii") if body.encoding_format == "base64"
                       else values.tolist())
            data.append(Embedding(embedding=encoded, index=index))
        tokens = sum(len(p.token_ids) for p in prompts)
        return EmbeddingResponse(data=data, model=self.ctx.model_name,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def _embed(self, token_ids: list[int], normalize: bool) -> torch.Tensor:
        """One input's vector, computed between two engine steps once the pool has room for it:
        while generation holds the blocks, new requests wait (LLMEngine.embed_when_room) and this
        asks again after later steps, so a busy pool delays an embedding instead of refusing it."""
        waiter = f"embed-{uuid.uuid4().hex}"
        try:
            while True:
                try:
                    vector = await self.ctx.engine.call(lambda e: e.embed_when_room(token_ids, normalize, waiter))
                except ValueError as exc:
                    raise APIError(400, str(exc), param="input") from exc
                if vector is not None:
                    return vector
                await asyncio.sleep(RETRY_S)
        finally:
            with contextlib.suppress(Exception):  # (an engine gone cannot hold anything back)
                await self.ctx.engine.call(lambda e: e.release_waiter(waiter))
