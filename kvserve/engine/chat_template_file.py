"""`--chat-template`: a chat template given on the command line, as vLLM reads it.

The value is a file holding a Jinja template, or the template itself: an existing file wins; a
value with no `{`, `}` or newline that names no file is a mistyped path (an error, not a template
that renders its own file name); anything else is the template text. The template is compiled at
start-up, so a syntax error is a one-line start-up error rather than a 400 on every chat request.
"""
from __future__ import annotations

from pathlib import Path


def load_chat_template(value: str) -> str:
    """The template text `value` names or is; ValueError with a one-line reason otherwise."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, or with a NUL
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value!r}: cannot read it: {exc}") from None
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r} looks like a file path, but no such file exists "
                         f"(an inline template holds Jinja's {{{{ }}}} or {{% %}})")
    else:
        text = value
    if not text.strip():
        raise ValueError(f"--chat-template {value!r} is empty")
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateError as exc:
        raise ValueError(f"--chat-template is not a valid Jinja template: {exc}") from None
    return text
