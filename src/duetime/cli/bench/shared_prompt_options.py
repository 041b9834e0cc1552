"""The options of the benches whose requests share a prompt (`prefix-cache`,
`shared-prefill`): each request is a question after a shared system prompt, answered
greedily. Their model and prompts come from :mod:`.model` (``load_with_shared_prompts``).
"""

from __future__ import annotations

from typing import Annotated

import typer

SystemLenOpt = Annotated[int, typer.Option(min=16, help="The shared system prompt, tokens.")]
QuestionLenOpt = Annotated[int, typer.Option(min=1, help="Longest question after it, tokens.")]
NewTokensOpt = Annotated[int, typer.Option(min=1, help="Greedy tokens per answer.")]
