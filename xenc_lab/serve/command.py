"""``xenc-lab serve MODEL``: the model behind vLLM's scoring API on uvicorn, on loopback unless told otherwise."""
from __future__ import annotations

import argparse
import ipaddress
import logging

logger = logging.getLogger(__name__)


def add_parser(sub, positive_int) -> None:
    p = sub.add_parser("serve", help="serve a cross-encoder over HTTP: vLLM's /score and /rerank APIs",
                       description="Loads MODEL once and serves POST /score, /v1/score (vLLM's score API), /rerank, "
                                   "/v1/rerank (Jina's), /v2/rerank (Cohere's v2), GET /health and /v1/models, with "
                                   "the OpenAPI schema at /docs and /openapi.json. Concurrent requests share engine "
                                   "calls. Needs the serve extra (pip install 'xenc-lab[serve]').")
    p.add_argument("model", metavar="MODEL", help="model directory or hub id (cached hub ids load offline)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it, unauthenticated)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name requests' `model` must match and /v1/models lists (default: MODEL as given)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA where torch sees a GPU)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--max-documents", type=positive_int, default=1024, metavar="N",
                   help="pairs (documents) per request at most (default 1024)")
    p.add_argument("--max-request-bytes", type=positive_int, default=4 * 2**20, metavar="N",
                   help="request body size at most, in bytes (default 4 MiB)")
    p.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                   help="requests waiting for the engine at most; beyond, 503 with Retry-After (default 256)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_command)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_command(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .app import Limits, create_app
    except ImportError as err:
        raise ValueError(f"xenc-lab serve needs FastAPI and uvicorn: pip install 'xenc-lab[serve]' ({err})") from None
    from .. import Scorer

    limits = Limits(args.max_documents, args.max_request_bytes, args.max_queue)  # checked before the model loads
    scorer = Scorer(args.model, device=args.device, dtype=args.dtype, compile=args.compile)
    app = create_app(scorer, args.served_model_name, limits)
    print(scorer)
    if not _loopback(args.host):
        print(f"warning: serving on {args.host}: any machine that reaches it can use the model; there is no "
              "authentication")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
