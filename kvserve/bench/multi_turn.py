"""The multi-turn agent workload (`--dataset-name multi-turn`): S chat sessions of T turns each.

Every session opens with the same system prompt (shared by all sessions) and its own first user
message. Turn k sends the whole conversation so far (the system prompt, the k-1 earlier user
messages and the server's k-1 answers, as chat messages) plus a new user message of U tokens, and
asks for exactly A answer tokens. The answers come from the server, so the conversations are only
known while the benchmark runs: this module fixes the texts (seeded spans of the bundled novel, or
of --dataset-path) and builds each turn's messages from the answers so far; the closed-loop driver
is kvserve/bench/multi_turn_run.py.

An agent's context grows like this: each turn's prompt is the previous turn's prompt and answer
plus one message, so a server that keeps (or offloads and reloads) the earlier KV computes only
the new tokens.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.bench.datasets import BookText, GivenAction, check_workload_flags


@dataclass(frozen=True)
class MultiTurnOptions:
    """The workload's shape; defaults are a small agent-like run on the bundled default model."""

    sessions: int = 16
    turns: int = 8
    system_prompt_len: int = 1024  # tokens; 0 = no system message
    user_len: int = 256  # tokens of each user message
    output_len: int = 64  # tokens of each answer (length-controlled: ignore_eos)
    think_time: float = 0.0  # seconds a session waits between an answer and its next turn

    def validate(self) -> None:
        checks = [("--multi-turn-sessions", self.sessions, 1), ("--multi-turn-turns", self.turns, 1),
                  ("--multi-turn-system-prompt-len", self.system_prompt_len, 0),
                  ("--multi-turn-user-len", self.user_len, 1), ("--multi-turn-output-len", self.output_len, 1)]
        for flag, value, least in checks:
            if value < least:
                raise ValueError(f"{flag} must be at least {least}, got {value}")
        if not (math.isfinite(self.think_time) and self.think_time >= 0):
            raise ValueError(f"--multi-turn-think-time must be a non-negative number of seconds, got {self.think_time}")

    @property
    def num_requests(self) -> int:
        return self.sessions * self.turns

    @property
    def last_turn_min_tokens(self) -> int:
        """Tokens the last turn needs at least (its messages' contents and its answer, without the
        chat template's own tokens)."""
        return self.system_prompt_len + self.turns * self.user_len + self.turns * self.output_len

    def check_fits(self, max_model_len: int) -> None:
        need = self.last_turn_min_tokens
        if need > max_model_len:
            raise ValueError(
                f"the multi-turn workload's last turn needs at least {need:,} tokens (system prompt + "
                f"{self.turns} user messages + {self.turns} answers) but the server's max_model_len is "
                f"{max_model_len:,}: lower --multi-turn-turns, --multi-turn-user-len, --multi-turn-output-len "
                "or --multi-turn-system-prompt-len")


@dataclass
class MultiTurnWorkload:
    options: MultiTurnOptions
    system_prompt: str  # "" when system_prompt_len is 0
    user_messages: list[list[str]]  # [session][turn]
    warmup_prompts: list[str]  # single-turn prompts sharing no prefix with the sessions

    def conversation(self, session: int, answers: list[str]) -> list[dict[str, str]]:
        """The messages of `session`'s turn len(answers) + 1, given the server's answers so far."""
        users = self.user_messages[session]
        if len(answers) >= len(users):
            raise IndexError(f"session {session} has only {len(users)} turns")
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for user, answer in zip(users, answers):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": users[len(answers)]})
        return messages


def build_multi_turn(tokenizer: Any, options: MultiTurnOptions, path: str | os.PathLike | None = None,
                     seed: int = 0, num_warmups: int = 0) -> MultiTurnWorkload:
    """Seeded texts for every session's turns: the same arguments give the same workload on every
    run and against every server. Each text re-encodes to exactly its token count."""
    options.validate()
    rng = np.random.default_rng(seed)
    book = BookText(tokenizer, path)
    system = book.span(rng, options.system_prompt_len)[0] if options.system_prompt_len else ""
    users = [[book.span(rng, options.user_len)[0] for _ in range(options.turns)] for _ in range(options.sessions)]
    # A warm-up prompt is one user message with no system prompt; it starts differently from every
    # session's first turn (a fresh span), so it primes no prefix the measured turns could hit.
    warmups = [book.span(rng, options.user_len)[0] for _ in range(num_warmups)]
    return MultiTurnWorkload(options, system, users, warmups)


def count_prompt_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """The prompt's tokens under the tokenizer's chat template (or the messages' own tokens when it
    has none); the server's usage report replaces this count when it gives one."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return len(tokenizer.encode(text, add_special_tokens=False))
        except Exception:  # a template that refuses e.g. a system message: fall back to the contents
            pass
    return sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages)


def add_multi_turn_args(parser: argparse.ArgumentParser) -> None:
    defaults = MultiTurnOptions()
    g = parser.add_argument_group("multi-turn workload (--dataset-name multi-turn)")
    g.add_argument("--multi-turn-sessions", action=GivenAction, metavar="S", type=int, default=defaults.sessions,
                   help=f"concurrent chat sessions (default {defaults.sessions})")
    g.add_argument("--multi-turn-turns", action=GivenAction, metavar="T", type=int, default=defaults.turns,
                   help=f"turns per session (default {defaults.turns})")
    g.add_argument("--multi-turn-system-prompt-len", action=GivenAction, metavar="N", type=int,
                   default=defaults.system_prompt_len,
                   help="tokens of the system prompt all sessions share; 0 = none "
                        f"(default {defaults.system_prompt_len})")
    g.add_argument("--multi-turn-user-len", action=GivenAction, metavar="U", type=int, default=defaults.user_len,
                   help=f"tokens of each user message (default {defaults.user_len})")
    g.add_argument("--multi-turn-output-len", action=GivenAction, metavar="A", type=int, default=defaults.output_len,
                   help=f"tokens of each answer, exactly (ignore_eos; default {defaults.output_len})")
    g.add_argument("--multi-turn-think-time", action=GivenAction, metavar="SECONDS", type=float,
                   default=defaults.think_time,
                   help="seconds a session waits after an answer before its next turn (default 0)")


def options_from_args(args: argparse.Namespace) -> MultiTurnOptions:
    check_workload_flags(args)
    if getattr(args, "num_prompts_given", False):
        raise ValueError("--num-prompts does not apply to --dataset-name multi-turn: it sends "
                         "--multi-turn-sessions x --multi-turn-turns requests")
    options = MultiTurnOptions(args.multi_turn_sessions, args.multi_turn_turns, args.multi_turn_system_prompt_len,
                               args.multi_turn_user_len, args.multi_turn_output_len, args.multi_turn_think_time)
    options.validate()
    return options
