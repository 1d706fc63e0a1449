"""From messages to prompt tokens and snapshot positions.

    template.py    render a model's Jinja2 chat template as Hugging Face transformers does
    control.py     content is data: caller strings never become control tokens
    boundaries.py  where the template's message, system and tools blocks end, found by rendering probes
    builder.py     PromptBuilder: messages → Prompt (text, token ids, boundaries)
"""

from .builder import Prompt, PromptBuilder

__all__ = ["Prompt", "PromptBuilder"]
