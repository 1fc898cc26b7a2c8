"""A time and output budget for rendering chat templates.

A chat template is a Jinja program that ships with the model files; transformers renders it in
jinja2's sandbox, which stops it reaching Python internals but not looping forever: nested
`range(100000)` loops hang the process. Here the template transformers compiled is given a
budget: its `range` counts every step it hands out and checks the clock, and rendering streams the
output, checking its length and the clock as it goes. Past the budget the render stops with a
TemplateBudgetError (a ValueError: a 400 for a request, one line and exit 2 for the CLI).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterator

MAX_SECONDS = 5.0  # wall time of one render
MAX_OUTPUT_CHARS = 64 * 2 ** 20  # characters one render may produce
MAX_RANGE_STEPS = 2_000_000  # steps all of a render's range() calls may hand out together

_budget = threading.local()  # this thread's render: deadline, steps left


class TemplateBudgetError(ValueError):
    """A chat template went past its rendering budget."""


def _over(what: str) -> TemplateBudgetError:
    return TemplateBudgetError(f"the model's chat template exceeded its rendering budget ({what}); "
                               f"it is refused rather than run without bound")


def _budgeted_range(*args: int) -> Iterator[int]:
    steps = range(*args)  # range's own checks (ints, step != 0)
    if len(steps) > MAX_RANGE_STEPS:
        raise _over(f"range() of {len(steps)} steps, more than {MAX_RANGE_STEPS}")
    return _counted(steps)


def _counted(steps: range) -> Iterator[int]:
    for value in steps:
        _budget.steps -= 1
        if _budget.steps < 0:
            raise _over(f"more than {MAX_RANGE_STEPS} loop steps")
        if _budget.steps % 4096 == 0 and time.monotonic() > _budget.deadline:
            raise _over(f"more than {MAX_SECONDS:g} s")
        yield value


def _budgeted_render(template: Any, *args: Any, **kwargs: Any) -> str:
    _budget.deadline = time.monotonic() + MAX_SECONDS
    _budget.steps = MAX_RANGE_STEPS
    parts, size = [], 0
    for chunk in template.generate(*args, **kwargs):
        size += len(chunk)
        if size > MAX_OUTPUT_CHARS:
            raise _over(f"more than {MAX_OUTPUT_CHARS} characters of output")
        if time.monotonic() > _budget.deadline:
            raise _over(f"more than {MAX_SECONDS:g} s")
        parts.append(chunk)
    return "".join(parts)


def guard_chat_template(tokenizer: Any, tools: list[dict] | None, chat_template: str | None = None) -> None:
    """Give the template `tokenizer.apply_chat_template` is about to render (`chat_template`, else
    the tokenizer's; transformers compiles and caches it per template text) the budget; once per
    compiled template."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template(tokenizer.get_chat_template(chat_template, tools))
    if getattr(compiled, "_kvserve_budget", False):
        return
    compiled.globals["range"] = _budgeted_range
    compiled.render = lambda *args, **kwargs: _budgeted_render(compiled, *args, **kwargs)
    compiled._kvserve_budget = True
