"""tokenizer.json post-processors: what ``add_special_tokens=True`` adds around one sequence's ids.

    TemplateProcessing  the ``single`` template: ``SpecialToken`` pieces (their ``ids``) around ``Sequence`` A
                        (Llama 3: <|begin_of_text|> first; Llama 2 / Mistral: <s> first)
    ByteLevel           nothing to the ids (it trims offsets, which ids do not have)
    Sequence            each in order

Only single sequences are encoded here (no pairs), so the ``pair`` template is not read.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.tokenizer.json_fields import Node

SUPPORTED = ("TemplateProcessing", "ByteLevel", "Sequence")


@dataclass(frozen=True)
class PostProcessor:
    prefix: tuple[int, ...] = ()  # ids before the sequence
    suffix: tuple[int, ...] = ()  # ids after it

    def apply(self, ids: list[int]) -> list[int]:
        return [*self.prefix, *ids, *self.suffix] if self.prefix or self.suffix else ids

    def then(self, other: PostProcessor) -> PostProcessor:
        """This one, then ``other`` around the result."""
        return PostProcessor(other.prefix + self.prefix, self.suffix + other.suffix)


def build_post_processor(node: Node) -> PostProcessor:
    if node.value is None:
        return PostProcessor()
    kind = node.type_of(SUPPORTED)
    if kind == "ByteLevel":
        return PostProcessor()
    if kind == "Sequence":
        result = PostProcessor()
        for child in node.items("processors"):
            result = result.then(build_post_processor(child))
        return result
    specials = node.child("special_tokens")
    ids_of = {}
    for name in node.get("special_tokens", dict, {}):
        ids = specials.child(name).get("ids", list)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise specials.child(name).error("must be a list of token ids", "ids")
        ids_of[name] = tuple(ids)
    before, after, seen = [], [], False
    for i, piece in enumerate(node.items("single")):
        value = piece.value
        if isinstance(value, dict) and set(value) == {"Sequence"}:
            if value["Sequence"].get("id") != "A" or seen:
                raise node.error('must hold the sequence once, as {"Sequence": {"id": "A"}}', f"single[{i}]")
            seen = True
        elif isinstance(value, dict) and set(value) == {"SpecialToken"}:
            name = value["SpecialToken"].get("id")
            if name not in ids_of:
                raise node.error(f"names the special token {name!r}, which special_tokens does not list", f"single[{i}]")
            (after if seen else before).extend(ids_of[name])
        else:
            raise node.error('must be {"Sequence": ...} or {"SpecialToken": ...}', f"single[{i}]")
    if not seen:
        raise node.error('has no {"Sequence": {"id": "A"}}', "single")
    return PostProcessor(tuple(before), tuple(after))
