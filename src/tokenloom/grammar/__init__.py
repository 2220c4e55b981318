"""Grammars for constrained decoding compiled into token-level indexes (outlines-core): :mod:`.compile`, the one
compile body, and :mod:`.worker`, the killable worker processes the server compiles in (a wall-clock limit and a
memory cap). Torch-free, below :mod:`tokenloom.generation.constraints`, which follows a compiled index per request."""
