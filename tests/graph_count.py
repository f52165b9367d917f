"""A torch.compile backend that keeps the graphs dynamo hands it, for tests that count where
a call breaks the graph (pinxfer's never_traced calls: pinxfer/_check.py)."""

from __future__ import annotations

from typing import Any

import torch


class CountingBackend:
    """``torch.compile(fn, backend=CountingBackend())``: each graph is kept in ``graphs`` and
    run as dynamo traced it (``gm.forward``, no further compiler)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs.append(gm)
        return gm.forward
