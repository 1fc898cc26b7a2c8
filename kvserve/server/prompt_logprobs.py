"""Prompt logprobs in the two shapes the API returns them: vLLM's `prompt_logprobs` field
(completions choices, the chat response) and, for completions with `echo` and `logprobs`, the
legacy logprobs lists of the echoed prompt, which come before the generated tokens' (what
lm-evaluation-harness reads to score multiple-choice tasks)."""
from __future__ import annotations

from kvserve.outputs import PromptLogprobs
from kvserve.server.prompts import Tokenization
from kvserve.server.protocol import CompletionLogprobs, PromptLogprob, PromptLogprobsField


def prompt_logprobs_field(entries: PromptLogprobs | None) -> PromptLogprobsField | None:
    if entries is None:
        return None
    return [None if entry is None else
            {token: PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=e.decoded_token)
             for token, e in entry.items()}
            for entry in entries]


def echoed_prompt_logprobs(tokens: Tokenization, prompt_ids: list[int], entries: PromptLogprobs | None,
                           k: int, as_ids: bool = False) -> CompletionLogprobs:
    """Legacy logprobs of the prompt's tokens: the first has none (null, as in vLLM), every other
    its logprob and, in top_logprobs, itself plus the k best at that position. Offsets count the
    tokens' texts from 0; `as_ids` names tokens "token_id:N" (Tokenization.token_name). Without entries (the sequence computing them failed) values are null."""
    result = CompletionLogprobs()
    offset = 0
    for i, token in enumerate(prompt_ids):
        name = tokens.token_name(token, as_ids)
        entry = entries[i] if entries is not None else None
        result.tokens.append(name)
        result.text_offset.append(offset)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            result.token_logprobs.append(entry[token].logprob)
            top = {tokens.token_name(t, as_ids): e.logprob for t, e in entry.items() if t != token and e.rank <= k}
            top[name] = entry[token].logprob
            result.top_logprobs.append(top)
        offset += len(tokens.token_text(token))
    return result
