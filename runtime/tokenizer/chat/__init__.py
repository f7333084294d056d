"""Hugging Face chat templates without Jinja2: the subset of Jinja2 real templates use, rendered exactly as
transformers' ``apply_chat_template`` renders it (sandboxed, trim_blocks and lstrip_blocks on), with the
standard library only.

    lexer.py        source -> tokens (whitespace control, trim_blocks, lstrip_blocks, raw, comments)
    stream.py       the parser's view of the tokens
    expressions.py  tokens -> expression nodes (Jinja2's grammar and precedence)
    parser.py       tokens -> statement nodes (if, for, set, macro, filter, break/continue, generation)
    nodes.py        the node classes
    values.py       Undefined, namespace, loop, Markup; attribute / item access and calls under the sandbox
    filters.py predicates.py   filters and tests
    evaluator.py renderer.py   nodes compiled once into closures: expressions, then statements
    template.py     ChatTemplate: from_folder, render, assistant_spans
    errors.py       ChatTemplateError, one line naming the template line
"""

from runtime.tokenizer.chat.errors import ChatTemplateError
from runtime.tokenizer.chat.template import ChatRendering, ChatTemplate

__all__ = ["ChatRendering", "ChatTemplate", "ChatTemplateError"]
