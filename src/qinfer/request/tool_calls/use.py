"""What one request does with tools: the tools it offers, whether a call is forced, and
the parsers of its replies in the model's format."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qinfer.request.tool_calls.formats import ToolCallFormat
from qinfer.request.tool_calls.parser import ToolCallParser
from qinfer.request.tool_calls.xml_calls import XmlCallParser


@dataclass(frozen=True)
class ToolUse:
    """The tools one request offers, in the model's format, and whether a call is forced.

    forced: "required" (some tool), a tool's name (that tool), or None (`auto`).
    parameters: {name: parameters schema} of the tools (XML calls read their values by
    the schema's types).
    """

    fmt: ToolCallFormat
    tool_names: tuple[str, ...]
    forced: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def parser(self) -> ToolCallParser | XmlCallParser:
        """A parser for one reply (one per choice)."""
        if self.fmt.xml:
            return XmlCallParser(self._schemas(), forced=self.forced is not None)
        return ToolCallParser(self.fmt, self.tool_names, forced=self.forced is not None)

    def reasoning_parser(self, main: ToolCallParser | XmlCallParser) -> XmlCallParser | None:
        """A parser for the reply's reasoning that finds the XML calls a model wrote
        inside `<think>` (numbered with `main`'s, the reply's parser); None for the JSON
        formats, whose calls come after the block."""
        if not isinstance(main, XmlCallParser):
            return None
        return XmlCallParser(self._schemas(), forced=False, log=main.log)

    def _schemas(self) -> dict[str, Any]:
        return {name: self.parameters.get(name) or {} for name in self.tool_names}
