"""A request's prompt tokens and block hashes, computed the way the replica behind will compute them.

The prompt is rendered with the engine's own functions (the chat template through
`output_processor.apply_chat_template`, text through `output_processor.tokenize`, messages through
the server's `conversation`) and hashed with the cache layer's `root_hash` and
`prompt_block_hashes`, under the namespace and block size the replica publishes and the request's
`cache_salt`. A body the router cannot read (invalid JSON or fields) yields no tokens: it is routed
by load alone and the replica answers it with its own 400.
"""
from __future__ import annotations

from typing import Any

from kvserve.cache.kv_cache_manager import prompt_block_hashes, root_hash
from kvserve.engine.output_processor import apply_chat_template, tokenize
from kvserve.server.errors import APIError
from kvserve.server.prompts import conversation
from kvserve.server.protocol import ChatCompletionRequest


class PromptTokens:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def token_ids(self, route: str, body: Any) -> list[int] | None:
        """The first prompt's token ids for `route` ("completions" or "chat"), None if unreadable.
        Runs in a worker thread (tokenizing is CPU work)."""
        if not isinstance(body, dict):
            return None
        try:
            if route == "chat":
                request = ChatCompletionRequest.model_validate(body)
                tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
                return apply_chat_template(self.tokenizer, conversation(request.messages),
                                           request.add_generation_prompt, tools)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # several prompts: route by the first
            if not prompt or not isinstance(prompt, (str, list)):
                return None
            return tokenize(self.tokenizer, prompt)[1]
        except (APIError, ValueError, TypeError, KeyError):
            return None
        except Exception:  # a chat template's own error; the replica reports it
            return None


def block_hashes(token_ids: list[int], namespace: str, block_size: int, cache_salt: str | None) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as a replica with this namespace makes them."""
    return prompt_block_hashes(root_hash(namespace, cache_salt), token_ids, block_size)
