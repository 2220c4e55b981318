"""``tokenloom serve CHECKPOINT``: the OpenAI-compatible server (:mod:`tokenloom.serving`) under uvicorn."""

from __future__ import annotations

import argparse
import os
import sys

from ..checkpoint import load_tokenizer, read_config, resolve_checkpoint
from ..errors import ConfigError


def serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..serving.app import ServeConfig, create_app
    except ImportError as err:
        raise ConfigError(f"serving needs {err.name or 'fastapi and uvicorn'}: pip install 'tokenloom[serve]'") \
            from None
    from .commands import load_inference_model

    for name in ("max_batch", "max_queue", "max_tokens", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [1, 65535], got {args.port}")
    ckpt = resolve_checkpoint(args.checkpoint)
    family = (read_config(ckpt).get("model") or {}).get("family", "gpt")
    if family not in ("gpt", "seq2seq", "nat"):
        raise ConfigError(f"{ckpt} holds a {family!r} model; the server serves language models (gpt) and "
                          "translation models (seq2seq, nat)")
    model, _ = load_inference_model(ckpt, args.precision)
    tokenizer = load_tokenizer(ckpt)
    name = args.model_name or (ckpt.parent.name if ckpt.name == "checkpoint" else ckpt.name)
    api_key = args.api_key or os.environ.get("TOKENLOOM_API_KEY") or None
    config = ServeConfig(model_name=name, api_key=api_key, max_batch=args.max_batch, max_queue=args.max_queue,
                         max_tokens=args.max_tokens, max_body_bytes=args.max_body_bytes,
                         request_timeout=args.request_timeout)
    app = create_app(model, tokenizer, config)
    where = f"http://{args.host}:{args.port}"
    print(f"serving {name} ({family}) at {where}/v1 (playground: {where}/)"
          + (" with an API key" if api_key else ""), file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
