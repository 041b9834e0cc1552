"""duetime: predictable LLM serving."""

__version__ = "0.1.0"
