"""Serving over HTTP: the OpenAI-compatible server and the load generator that measures it."""
