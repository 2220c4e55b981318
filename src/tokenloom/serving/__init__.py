"""Serving: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the ``serve`` extra) over a continuous-batching
engine. ``tokenloom serve CHECKPOINT`` runs it."""

from .engine import Engine, QueueFull, Request

__all__ = ["Engine", "QueueFull", "Request"]
