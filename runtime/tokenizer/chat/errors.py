"""The one error a chat template raises, and the line-less errors the evaluator turns into it.

Every problem (a tag or filter this engine does not have, bad syntax, an undefined value used where Jinja2 raises,
a sandbox violation, the template's own ``raise_exception``) reaches the caller as a one-line
``ChatTemplateError`` that names the template line: ``chat template line 12: unsupported tag 'include'``.
"""

from __future__ import annotations


class ChatTemplateError(ValueError):
    """``line``: the template line (None when the error is not about one); ``template_message``: the text a
    template passed to ``raise_exception`` (None for every other error)."""

    def __init__(self, message: str, *, line: int | None = None, template_message: str | None = None):
        super().__init__(f"chat template line {line}: {message}" if line is not None else f"chat template: {message}")
        self.line = line
        self.template_message = template_message


class TemplateRuntimeError(Exception):
    """Raised while evaluating, where the line is not known yet; the statement that ran it adds the line."""


class UndefinedError(TemplateRuntimeError):
    """An undefined value used where Jinja2's default ``Undefined`` raises (arithmetic, attribute, call...)."""


class SecurityError(TemplateRuntimeError):
    """What Jinja2's ImmutableSandboxedEnvironment refuses: underscore attributes, methods that change a value."""


class RaisedByTemplate(TemplateRuntimeError):
    """``raise_exception(message)`` called by the template."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def with_line(error: BaseException, line: int) -> ChatTemplateError:
    """``error`` (raised while running the statement on ``line``) as the one-line ChatTemplateError."""
    if isinstance(error, RaisedByTemplate):
        return ChatTemplateError(error.message, line=line, template_message=error.message)
    if isinstance(error, TemplateRuntimeError):
        return ChatTemplateError(str(error), line=line)
    text = " ".join(str(error).split())  # one line, whatever the message held
    return ChatTemplateError(f"{type(error).__name__}: {text}" if text else type(error).__name__, line=line)
