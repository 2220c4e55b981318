"""``tokenloom index DOCS --out INDEX`` (a retrieval index: :mod:`tokenloom.retrieval`), ``tokenloom generate CKPT
--rag INDEX`` (retrieval-augmented generation: the answer, its citations and the fact check) and the ``serve --rag``
options. Importing this module imports no torch (``main.py`` builds its parsers from it)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from ..errors import ConfigError

RAG_DEFAULTS = {"rag_top_k": 3, "retriever": "bm25", "rag_alpha": 0.5, "rag_encoder": None, "rag_template": None,
                "fact_check": None, "json": False}  # generate's RAG-only flags and their defaults
RETRIEVERS = ("bm25", "dense", "hybrid")  # (tokenloom.retrieval.search.RETRIEVERS, without importing torch)


def add_index(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("index", help="build a retrieval index of documents for `generate --rag` and `serve --rag`",
                       description="Index documents for retrieval-augmented generation: a directory of .txt / .md "
                                   "files (each a document, its id the relative path) or a JSONL file of {\"id\", "
                                   "\"text\", \"title\"} objects. Long documents are cut into overlapping passages of "
                                   "words (ids '<doc>#<k>'); BM25 (bm25s, the 'rag' extra) always, and with --encoder "
                                   "dense embeddings by a language model checkpoint (mean-pooled final hidden states).")
    p.add_argument("documents", help="a directory of .txt / .md files, one such file, or a .jsonl file")
    p.add_argument("--out", required=True, help="index directory to write")
    p.add_argument("--encoder", default=None, metavar="CKPT",
                   help="also embed the passages with this causal LM checkpoint (for --retriever dense | hybrid)")
    p.add_argument("--chunk-size", type=int, default=100, help="words per passage at most")
    p.add_argument("--chunk-overlap", type=int, default=20, help="words shared by neighbouring passages")
    p.add_argument("--k1", type=float, default=1.5, help="BM25 term-frequency saturation")
    p.add_argument("--b", type=float, default=0.75, help="BM25 length normalisation in [0, 1]")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    from ..devices import DEVICE_HELP, default_device

    p.add_argument("--device", default=default_device(), help=f"where --encoder runs: {DEVICE_HELP}")
    p.set_defaults(func=index)


def add_rag_options(p: argparse.ArgumentParser) -> None:
    """``generate``'s retrieval-augmented options."""
    p.add_argument("--rag", default=None, metavar="INDEX",
                   help="retrieval-augmented generation: --prompt is the question; the top passages of this index "
                        "(`tokenloom index`) go into the prompt; prints the answer (up to a line break unless --stop "
                        "says otherwise), its citations and the retrieved passages")
    p.add_argument("--rag-top-k", type=int, default=3, metavar="K", help="with --rag: passages retrieved")
    p.add_argument("--retriever", choices=RETRIEVERS, default="bm25",
                   help="with --rag: bm25, dense (cosine of the index's encoder embeddings) or hybrid (alpha x "
                        "min-max dense + (1 - alpha) x min-max bm25)")
    p.add_argument("--rag-alpha", type=float, default=0.5, metavar="A", help="with --retriever hybrid: the dense "
                                                                             "score's weight in [0, 1]")
    p.add_argument("--rag-encoder", default=None, metavar="CKPT",
                   help="with --rag dense | hybrid: the query encoder (default: the checkpoint the index was built "
                        "with; it must have the same tokenizer)")
    p.add_argument("--rag-template", default=None, metavar="TEXT",
                   help="with --rag: the prompt, holding {passages} and {question} (\\n is a line break; default "
                        "'{passages}\\n\\nQuestion: {question}\\nAnswer:')")
    p.add_argument("--fact-check", nargs="?", const="lexical", choices=("lexical", "model"), default=None,
                   help="with --rag: mark each span of the answer supported or not by the passages (lexical: their "
                        "words; model: the passages raise the span's log-likelihood)")
    p.add_argument("--json", action="store_true", help="with --rag: print the result as one JSON object")


def add_serve_rag_options(p: argparse.ArgumentParser) -> None:
    """``serve``'s POST /v1/rag options."""
    p.add_argument("--rag", default=None, metavar="INDEX",
                   help="also answer POST /v1/rag (retrieve from this index, generate, cite): a language model only")
    p.add_argument("--retriever", choices=RETRIEVERS, default="bm25", help="with --rag: the default retriever")
    p.add_argument("--rag-encoder", default=None, metavar="CKPT",
                   help="with --rag dense | hybrid: the query encoder (default: the index's own)")


def index(args: argparse.Namespace) -> int:
    from ..retrieval import BM25Config, Encoder, IndexConfig, build_index

    config = IndexConfig(chunk_size=args.chunk_size, chunk_overlap=args.chunk_overlap,
                         bm25=BM25Config(k1=args.k1, b=args.b))
    encoder = None
    if args.encoder is not None:
        from .loading import command_device

        encoder = Encoder.load(args.encoder, command_device(args.device).device)
    built = build_index(args.documents, args.out, config, encoder, force=args.force)
    dense = "" if encoder is None else f" and {encoder.dim}-dimensional embeddings by {encoder.checkpoint}"
    print(f"indexed {built.meta['passages']} passages of {built.meta['documents']} documents -> {args.out} (BM25"
          f"{dense})", file=sys.stderr)
    return 0


def rag_requested(args: argparse.Namespace) -> bool:
    """``generate`` runs retrieval-augmented: --rag, or a RAG-only flag (whose one-line error :func:`generate_rag`
    gives)."""
    return getattr(args, "rag", None) is not None or bool(_rag_flags(args))


def _rag_flags(args: argparse.Namespace) -> list[str]:
    """The RAG-only flags given (not at their defaults)."""
    return [name for name, default in RAG_DEFAULTS.items() if getattr(args, name, default) != default]


def generate_rag(args: argparse.Namespace, unescape: Callable[[str], str]) -> int:
    """``tokenloom generate CKPT --rag INDEX --prompt QUESTION``: the answer, then its citations, the retrieved
    passages and (``--fact-check``) each span's verdict; ``--json``: one object. ``unescape`` reads the backslash
    escapes of ``--stop`` and ``--rag-template`` as ``generate`` does (``commands.unescape``)."""
    rag_config, generation = _rag_settings(args, unescape)
    from ..checkpoint import load_tokenizer
    from ..retrieval import Retriever, rag_generate
    from .loading import command_device, load_inference_model
    from .vision import refuse_image_checkpoint

    refuse_image_checkpoint(args.checkpoint, "generate", "`tokenloom classify`")
    model, _ = load_inference_model(args.checkpoint, args.precision, args.device)
    tokenizer = load_tokenizer(args.checkpoint)
    from ..models.registry import decoding_of

    if decoding_of(model) != "causal_lm":
        raise ConfigError("--rag needs a causal language model (a translation model: use `tokenloom translate`)")
    retriever = Retriever.open(args.rag, rag_config.retriever, args.rag_encoder, command_device(args.device).device)
    result = rag_generate(model, tokenizer, retriever, args.prompt, rag_config, generation)
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
        return 0
    print(result.answer)
    print(f"citations: {', '.join(result.citations) or '(none: no passage in the prompt holds the answer)'}")
    print("passages: " + ", ".join(f"{h.passage.id} ({h.score:.3f})" for h in result.hits))
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if result.fact_check is not None:
        check = result.fact_check
        print(f"fact check ({check.method}): {len(check.spans) - len(check.unsupported)} of {len(check.spans)} spans "
              "supported")
        for span in check.spans:
            where = f" ({', '.join(span.passages)})" if span.passages else ""
            print(f"  [{'supported' if span.supported else 'UNSUPPORTED'}] {span.text!r}{where}")
    return 0


def _rag_settings(args: argparse.Namespace, unescape: Callable[[str], str]):  # noqa: ANN202 - (RagConfig, GenerationConfig)
    """The RAG and generation settings of ``generate --rag``, checked in one line before anything loads."""
    if args.rag is None:
        flag = _rag_flags(args)[0].replace("_", "-")
        raise ConfigError(f"--{flag} applies to retrieval-augmented generation: give --rag INDEX")
    if getattr(args, "chat", None) is not None:
        raise ConfigError("--chat and --rag are two kinds of prompt: give one")
    if getattr(args, "best_of", None) is not None or getattr(args, "reward_model", None) is not None:
        raise ConfigError("--rag generates one answer: --best-of and --reward-model do not apply")
    if args.beam > 1 or args.num_samples > 1:
        raise ConfigError("--rag generates one answer: --beam and --num-samples do not apply")
    if args.draft is not None or args.prompt_lookup or args.exit_threshold is not None or args.compile:
        raise ConfigError("--rag runs plain greedy decoding or sampling: --draft, --prompt-lookup, --exit-threshold "
                          "and --compile do not apply")
    if args.prompt in ("", "\n"):
        raise ConfigError("--rag answers a question: give it with --prompt")
    from ..generation import GenerationConfig
    from ..retrieval import RagConfig

    extra = {} if args.rag_template is None else {"template": unescape(args.rag_template)}
    rag = RagConfig(top_k=args.rag_top_k, retriever=args.retriever, alpha=args.rag_alpha, fact_check=args.fact_check,
                    **extra)
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  do_sample=not args.greedy and args.temperature > 0, top_k=args.top_k,
                                  top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                                  stop_strings=[unescape(text) for text in args.stop])  # none: the RAG line break
    return rag, generation


def serving_rag(args: argparse.Namespace, model, tokenizer, device):  # noqa: ANN001, ANN201 - a RagService or None
    """``serve --rag INDEX``: the retriever and the default settings of POST /v1/rag, every passage checked to be
    encodable by the served model's tokenizer (one line at start, not a 400 per request); None without --rag."""
    if getattr(args, "rag", None) is None:
        if getattr(args, "rag_encoder", None) is not None or getattr(args, "retriever", "bm25") != "bm25":
            raise ConfigError("--retriever and --rag-encoder apply to --rag INDEX")
        return None
    from ..errors import TokenizerError
    from ..models.registry import decoding_of
    from ..retrieval import RagConfig, Retriever
    from ..serving.routes.rag import RagService

    if decoding_of(model) != "causal_lm":
        raise ConfigError("--rag serves a language model's answers; this checkpoint holds a translation model")

    retriever = Retriever.open(args.rag, args.retriever, args.rag_encoder, device)
    for passage in retriever.index.passages:
        try:
            tokenizer.encode(f"[{passage.id}] {passage.content}")
        except TokenizerError as err:
            raise ConfigError(f"--rag {args.rag}: passage {passage.id!r} cannot be encoded by the served model's "
                              f"tokenizer ({err})") from None
    return RagService(retriever, RagConfig(retriever=args.retriever))
