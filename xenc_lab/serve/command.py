"""``xenc-lab serve MODEL``: the model behind vLLM's scoring API on uvicorn, on loopback unless told otherwise."""
from __future__ import annotations

import argparse
import ipaddress
import logging

from .. import settings
from ..config import QUANTIZATION_HELP, QUANTIZATIONS

API_KEY_ENV = "XENC_LAB_API_KEY"  # vLLM's is VLLM_API_KEY


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def add_parser(sub, positive_int) -> None:
    p = sub.add_parser("serve", help="serve a cross-encoder over HTTP: vLLM's /score and /rerank APIs",
                       description="Loads MODEL once and serves POST /score, /v1/score (vLLM's score API), /rerank, "
                                   "/v1/rerank (Jina's), /v2/rerank (Cohere's v2), GET /health, /v1/models and "
                                   "/metrics (Prometheus), with the OpenAPI schema at /docs and /openapi.json. "
                                   "Concurrent requests share engine calls. Needs the serve extra "
                                   "(pip install 'xenc-lab[serve]'). docs/serving.md tells the rest.")
    p.add_argument("model", metavar="MODEL", help="model directory or hub id (cached hub ids load offline)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; another exposes it: set --api-key)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name requests' `model` must match and /v1/models lists (default: MODEL as given)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA where torch sees a GPU)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help=QUANTIZATION_HELP)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"every route but /health needs 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, which "
                        "keeps the key out of the process list; neither: no key)")
    p.add_argument("--max-documents", type=positive_int, default=1024, metavar="N",
                   help="pairs (documents) per request at most (default 1024)")
    p.add_argument("--max-request-bytes", type=positive_int, default=4 * 2**20, metavar="N",
                   help="request body size at most, in bytes (default 4 MiB)")
    p.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                   help="requests waiting for the engine at most; beyond, 503 with Retry-After (default 256)")
    p.add_argument("--body-timeout", type=_seconds, default=30.0, metavar="S",
                   help="a request's head, and then its body, must arrive within S seconds; else 408 and the "
                        "connection is closed (default 30)")
    p.add_argument("--request-timeout", type=_seconds, default=600.0, metavar="S",
                   help="a request not answered S seconds after its body arrived gets 504 (default 600)")
    p.add_argument("--timeout-keep-alive", type=_seconds, default=5.0, metavar="S",
                   help="close a connection idle S seconds after an answer (uvicorn's option; default 5)")
    p.add_argument("--limit-concurrency", type=positive_int, default=None, metavar="N",
                   help="uvicorn's option: past N open connections and requests, new requests get 503 (default: "
                        "no limit)")
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="TLS: the key (uvicorn's option)")
    p.add_argument("--ssl-certfile", default=None, metavar="FILE", help="TLS: the certificate (uvicorn's option)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="of uvicorn and of the server's own logs: info writes one access line per request (default)")
    p.set_defaults(func=run_command)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_command(args: argparse.Namespace) -> int:
    try:
        from .app import Limits, create_app
        from .server import Server, config_for
    except ImportError as err:
        raise ValueError(f"xenc-lab serve needs FastAPI, uvicorn and prometheus-client: pip install "
                         f"'xenc-lab[serve]' ({err})") from None
    from .. import Scorer

    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
    api_key = args.api_key if args.api_key is not None else settings.get(API_KEY_ENV)
    # checked before the model loads
    limits = Limits(args.max_documents, args.max_request_bytes, args.max_queue, args.body_timeout, args.request_timeout)
    scorer = Scorer(args.model, device=args.device, dtype=args.dtype, compile=args.compile,
                    quantization=args.quantization)
    app = create_app(scorer, args.served_model_name, limits, api_key=api_key)
    print(scorer)
    if not _loopback(args.host) and api_key is None:
        print(f"warning: serving on {args.host}: any machine that reaches it can use the model; there is no "
              f"authentication (set --api-key or ${API_KEY_ENV})")
    logger = logging.getLogger("xenc_lab.serve")
    logger.setLevel(args.log_level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    config = config_for(app, args.host, args.port, args.log_level, timeout_keep_alive=args.timeout_keep_alive,
                        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                        limit_concurrency=args.limit_concurrency)
    Server(config, app).run()
    return 0
