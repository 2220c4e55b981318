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
    from .loading import command_device, load_inference_model

    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [1, 65535], got {args.port}")
    from ..serving.transport import TransportLimits, raise_fd_limit

    limits = TransportLimits(timeout_keep_alive=args.timeout_keep_alive, timeout_read=args.timeout_read,
                             limit_concurrency=args.limit_concurrency, limit_connections=args.limit_connections,
                             backlog=args.backlog, max_header_bytes=args.max_header_bytes,
                             fd_limit=raise_fd_limit())  # the connection cap is sized under ulimit -n, raised
    ckpt = resolve_checkpoint(args.checkpoint)
    family = (read_config(ckpt).get("model") or {}).get("family", "gpt")
    if family not in ("gpt", "seq2seq", "nat"):
        raise ConfigError(f"{ckpt} holds a {family!r} model; the server serves language models (gpt) and "
                          "translation models (seq2seq, nat)")
    name = args.model_name or (ckpt.parent.name if ckpt.name == "checkpoint" else ckpt.name)
    api_key = args.api_key or os.environ.get("TOKENLOOM_API_KEY") or None
    _check_speculative(args, family)
    config = ServeConfig(model_name=name, api_key=api_key, max_batch=args.max_batch, max_queue=args.max_queue,
                         max_tokens=args.max_tokens, max_body_bytes=args.max_body_bytes,
                         request_timeout=args.request_timeout, host=args.host,
                         allowed_hosts=_listed(args.allowed_hosts), cors_origins=_listed(args.cors_origin),
                         prompt_lookup=args.prompt_lookup, num_draft_tokens=args.num_draft_tokens,
                         block_size=args.block_size, kv_blocks=args.kv_blocks, prefix_caching=args.prefix_caching,
                         prefill_tokens=args.prefill_tokens, grammar_seconds=args.grammar_seconds,
                         grammar_memory_mb=args.grammar_memory_mb, log_requests=args.verbose)
    if family == "gpt":
        _check_cache_budget(ckpt, config, args.precision)  # before the model loads
    # the flags are checked (above) before the model loads
    model, _ = load_inference_model(ckpt, args.precision, args.device)
    tokenizer = load_tokenizer(ckpt)
    draft = _load_draft(args, tokenizer)
    from .index import serving_rag

    rag = serving_rag(args, model, tokenizer, command_device(args.device).device)  # --rag INDEX: POST /v1/rag
    app = create_app(model, tokenizer, config, draft, rag)
    _browser_safety_notes(config)
    where = f"http://{args.host}:{args.port}"
    print(f"serving {name} ({family}) at {where}/v1 (playground: {where}/)"
          + (" with an API key" if api_key else ""), file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                **limits.uvicorn_options())
    return 0


def _check_speculative(args: argparse.Namespace, family: str) -> None:
    """``--draft`` / ``--prompt-lookup`` / ``--num-draft-tokens`` checked in one line before anything loads (their
    values by :class:`~tokenloom.serving.config.ServeConfig`)."""
    if args.draft is None and not args.prompt_lookup:
        if args.num_draft_tokens != 4:
            raise ConfigError("--num-draft-tokens applies to speculative decoding: give --draft or --prompt-lookup")
        return
    if args.draft is not None and args.prompt_lookup:
        raise ConfigError("--draft and --prompt-lookup are two drafters: give one")
    if family != "gpt":
        raise ConfigError(f"speculative decoding (--draft, --prompt-lookup) applies to a language model's "
                          f"completions; the checkpoint holds a {family!r} model")


def _load_draft(args: argparse.Namespace, tokenizer):  # noqa: ANN202 - a model or None
    """The ``--draft`` model, loaded like the model (precision, device) and checked to be a causal language model
    sharing the model's tokenizer (its vocabulary and context: by the engine); None without ``--draft``."""
    if args.draft is None:
        return None
    from ..generation import check_draft_tokenizer
    from ..models.registry import decoding_of
    from .loading import load_inference_model

    draft, _ = load_inference_model(args.draft, args.precision, args.device)
    if decoding_of(draft) != "causal_lm":
        raise ConfigError(f"--draft {args.draft} decodes as {decoding_of(draft)!r}: the server's drafter must be a "
                          "causal language model")
    check_draft_tokenizer(tokenizer, load_tokenizer(args.draft))
    return draft


def _check_cache_budget(ckpt, config, precision: str) -> None:  # noqa: ANN001 - a Path and a ServeConfig
    """The engine preallocates its paged KV cache: ``--kv-blocks`` blocks of ``--block-size`` positions (default: as
    many positions as ``--max-batch`` rows of the model's whole context; :class:`tokenloom.serving.engine.Engine`):
    refuse a cache that cannot fit in memory in one line, before the model loads (:mod:`tokenloom.budget`).
    ``--precision auto`` counts 2 bytes a value (bf16, the smaller choice)."""
    from ..errors import TokenloomError
    from ..models.factory import model_config_from_dict
    from ..models.sizes import check_kv_cache

    try:
        _, model_config = model_config_from_dict(read_config(ckpt).get("model") or {})
    except TokenloomError:
        return  # a broken config: loading the model says what is wrong with it
    bs = config.block_size
    if config.kv_blocks is None:
        rows, what = config.max_batch, f"--max-batch {config.max_batch}"
        positions = -(-model_config.max_seq_len // bs) * bs
    else:
        rows, what = 1, f"--kv-blocks {config.kv_blocks}"
        positions = config.kv_blocks * bs
    check_kv_cache(model_config, rows, positions, 4 if precision == "fp32" else 2, what, error=ConfigError)


def _listed(values: list[str] | None) -> tuple[str, ...]:
    """A repeatable, comma-separated flag as one tuple: ``--x a,b --x c`` -> ``("a", "b", "c")``."""
    return tuple(v.strip() for value in values or () for v in value.split(",") if v.strip())


def _browser_safety_notes(config) -> None:  # noqa: ANN001 - a ServeConfig
    """Warnings for settings that reach past this machine's own browser (see ``--allowed-hosts``)."""
    policy = config.host_policy
    if policy.any_address and not policy.any_host:
        print(f"warning: --host {config.host} listens on every interface: Host headers naming localhost or an IP "
              "address are answered; clients that use a DNS name need --allowed-hosts NAME"
              + ("" if config.api_key else "; without --api-key anyone who can reach this machine may use it"),
              file=sys.stderr)
    if policy.any_host and not config.api_key:
        print("warning: --allowed-hosts '*' without --api-key: any web page can read this server's answers "
              "through DNS rebinding", file=sys.stderr)
    if "*" in config.cors_origins and not config.api_key:
        print("warning: --cors-origin '*' without --api-key: every web page may use this server", file=sys.stderr)
    if config.api_key is not None and not config.api_key.isascii():
        print("warning: the API key is not ASCII: clients must send it UTF-8 encoded (curl and the playground "
              "do; the openai Python client cannot send it)", file=sys.stderr)
