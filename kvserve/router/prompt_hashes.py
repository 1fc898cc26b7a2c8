"""A request's prompt tokens and block hashes, computed the way the replica behind will compute them.

The prompt is rendered with the engine's own functions (the chat template through
`output_processor.apply_chat_template`, text through `output_processor.tokenize`, messages through
the server's `conversation`, Anthropic's through its `chat_messages`, Responses input through its
`input_messages`) and hashed with the cache
layer's `root_hash` and `prompt_block_hashes`, under the namespace and block size the replica
publishes and the request's `cache_salt`. A body the router cannot read (invalid JSON or fields)
yields no tokens: it is routed by load alone and the replica answers it with its own 400.

Only the prompt's first ROUTING_PREFIX_CHARS characters are tokenized (its first
ROUTING_PREFIX_TOKENS tokens when sent as ids): the longest cached run the router looks for
starts at the prompt's beginning, and a whole 30 MB prompt would hold the router's tokenizer (and
gigabytes of its memory) for every request behind it. The last few tokens before a cut are
dropped, since tokenizing cut text can end differently from tokenizing it whole.
"""
from __future__ import annotations

from typing import Any

from kvserve.cache.kv_cache_manager import prompt_block_hashes, root_hash
from kvserve.engine.output_processor import render_chat_template, tokenize
from kvserve.server.errors import APIError
from kvserve.server.messages import MessagesRequest, chat_messages, chat_tools, is_prefill
from kvserve.server.responses import ResponsesRequest, input_messages
from kvserve.server.responses import chat_tools as responses_chat_tools
from kvserve.server.prompts import conversation
from kvserve.server.protocol import ChatCompletionRequest, template_fields

ROUTING_PREFIX_CHARS = 256 * 1024
ROUTING_PREFIX_TOKENS = 64 * 1024
_CUT_TOKENS = 16  # dropped after a cut: the text's last pre-token may tokenize differently whole


class PromptTokens:
    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        """`chat_template`: the replicas' --chat-template text (None: the tokenizer's)."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def token_ids(self, route: str, body: Any) -> list[int] | None:
        """The first prompt's token ids for `route` ("completions", "chat", "messages" or "responses"),
        None if unreadable.
        Runs in a worker thread (tokenizing is CPU work)."""
        if not isinstance(body, dict):
            return None
        try:
            if route == "responses":  # OpenAI's Responses API, rendered as the replica's chat path renders it
                responses = ResponsesRequest.model_validate(body)
                system = [{"role": "system", "content": responses.instructions}] if responses.instructions else []
                return self.token_ids("chat", {"messages": system + input_messages(responses.input),
                                                "tools": responses_chat_tools(responses.tools)})
            if route == "chat":
                request = ChatCompletionRequest.model_validate(body)
                if request.chat_template is not None or "chat_template" in (request.chat_template_kwargs or {}):
                    return None  # its own template: not rendered here (the replica may refuse it)
                tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
                text = render_chat_template(self.tokenizer, conversation(request.messages),
                                            request.add_generation_prompt, tools, request.continue_final_message,
                                            request.chat_template_kwargs, chat_template=self.chat_template,
                                            fields=template_fields(request))
                return self._prefix_ids(text, add_special_tokens=request.add_special_tokens)
            if route == "messages":  # Anthropic's, rendered as the replica's chat path renders it
                anthropic = MessagesRequest.model_validate(body)
                messages = chat_messages(anthropic)
                prefill = is_prefill(messages)
                text = render_chat_template(self.tokenizer, messages, not prefill, chat_tools(anthropic.tools),
                                            prefill, chat_template=self.chat_template)
                return self._prefix_ids(text, add_special_tokens=False)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # several prompts: route by the first
            if not prompt or not isinstance(prompt, (str, list)):
                return None
            if isinstance(prompt, str):
                return self._prefix_ids(prompt, add_special_tokens=body.get("add_special_tokens") is not False)
            return tokenize(self.tokenizer, prompt[:ROUTING_PREFIX_TOKENS])[1]
        except (APIError, ValueError, TypeError, KeyError):
            return None
        except Exception:  # a chat template's own error; the replica reports it
            return None


    def _prefix_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        cut = len(text) > ROUTING_PREFIX_CHARS
        if cut:
            text = text[:ROUTING_PREFIX_CHARS]
        if add_special_tokens:
            ids = tokenize(self.tokenizer, text)[1]
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[:-_CUT_TOKENS] if cut else ids


def block_hashes(token_ids: list[int], namespace: str, block_size: int, cache_salt: str | None) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as a replica with this namespace makes them."""
    return prompt_block_hashes(root_hash(namespace, cache_salt), token_ids, block_size)
