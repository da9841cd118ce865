"""One engine, one process: load it, warm it up, time ``--repeats`` passes over the pair file, write a JSON result.

Run by ``python -m xenc_lab.bench.peers`` in the engine's own environment (OpenVINO has its own venv), so this file
imports only the standard library at the top and each engine's library inside its own function. The result holds
the scores of the last pass (raw: logits, or logit("yes") - logit("no") for decoders), each pass's seconds and the
machine's busy CPU share over it; a failure is written as an ``error`` instead of scores.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

BATCH = 32  # sentence-transformers' default batch size, used by every engine that batches itself


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat; (0, 0) where there is none."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def _threads(n: int) -> None:
    """Every library's thread pools at ``n``: torch's here, the others' through their own settings."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:
        pass


def _read_pairs(path: str) -> list[tuple[str, str]]:
    return [tuple(json.loads(line)) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


# --- encoders ------------------------------------------------------------------------------------------------------

def st(args, dtype: str):
    import torch
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(args.model, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    identity = torch.nn.Identity()
    return lambda pairs: model.predict(pairs, activation_fn=identity, batch_size=BATCH)


def xenc_lab(args, dtype: str | None, quantization: str | None = None):
    import torch

    from xenc_lab import Scorer
    from xenc_lab.bench.timing import cpu_has_fast_bf16

    extra = {}
    if quantization is not None:
        dtype = dtype or ("bfloat16" if cpu_has_fast_bf16() else "float32")  # what stays unquantized
        import inspect

        if "quantization" not in inspect.signature(Scorer.__init__).parameters:
            raise NotImplementedError("Scorer has no quantization argument in this checkout")
        extra["quantization"] = quantization
    scorer = Scorer(args.model, device="cpu", dtype=dtype, **extra)
    identity = torch.nn.Identity()
    return lambda pairs: scorer.predict(pairs, activation_fn=identity)


def _openvino_config(precision: str | None) -> dict:
    config = {"INFERENCE_NUM_THREADS": str(args_threads), "PERFORMANCE_HINT": "LATENCY"}
    if precision:
        config["INFERENCE_PRECISION_HINT"] = precision
    return config


def openvino(args, precision: str | None, int8: bool = False):
    """sentence-transformers' OpenVINO backend: f32 (``precision="f32"``), the CPU's default (bf16 where it has bf16
    units), or int8 from NNCF's post-training quantization calibrated on ``--calibration``'s pairs."""
    from sentence_transformers import CrossEncoder
    import torch

    kwargs = {"ov_config": _openvino_config(precision)}
    path = args.model
    if int8:
        path, kwargs["file_name"] = _nncf_int8(args), "openvino/openvino_model_int8.xml"
    model = CrossEncoder(path, device="cpu", backend="openvino", model_kwargs=kwargs)
    identity = torch.nn.Identity()
    return lambda pairs: model.predict(pairs, activation_fn=identity, batch_size=BATCH)


def _nncf_int8(args) -> str:
    """A copy of the model folder with an NNCF int8 OpenVINO model beside it (quantized on the calibration pairs, each
    its own sample at its own length); the folder's path."""
    import shutil

    import nncf
    import openvino as ov
    from optimum.intel import OVModelForSequenceClassification
    from transformers import AutoTokenizer

    target = Path(args.work) / "openvino-int8"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(args.model, target, ignore=shutil.ignore_patterns("openvino", "onnx"))
    exported = OVModelForSequenceClassification.from_pretrained(args.model, export=True, compile=False)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    names = {i.get_any_name() for i in exported.model.inputs}
    samples = []
    for query, passage in _read_pairs(args.calibration):
        enc = tokenizer(query, passage, truncation=True, return_tensors="np")
        samples.append({k: v for k, v in enc.items() if k in names})
    quantized = nncf.quantize(exported.model, nncf.Dataset(samples), model_type=nncf.ModelType.TRANSFORMER,
                              subset_size=len(samples))
    (target / "openvino").mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(target / "openvino" / "openvino_model_int8.xml"))
    return str(target)


def onnxruntime(args, int8: bool = False):
    """ONNX Runtime on a torch.onnx export (eager attention, opset 17); ``int8``: its dynamic int8 quantization,
    per channel. Tokenization by the model's fast tokenizer, batches of BATCH padded to their longest pair."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, attn_implementation="eager").eval()
    max_length = min(tokenizer.model_max_length, model.config.max_position_embeddings)
    sample = tokenizer([["a query", "a passage"]] * 2, padding=True, return_tensors="pt")
    names = list(sample.keys())

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *inputs):
            return self.inner(**dict(zip(names, inputs))).logits

    path = Path(args.work) / "model.onnx"
    axes = {name: {0: "batch", 1: "tokens"} for name in names} | {"logits": {0: "batch"}}
    with torch.no_grad():
        torch.onnx.export(Logits(model).eval(), tuple(sample[n] for n in names), str(path), dynamo=False,
                          opset_version=17, input_names=names, output_names=["logits"], dynamic_axes=axes)
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantized = Path(args.work) / "model-int8.onnx"
        quantize_dynamic(str(path), str(quantized), per_channel=True, weight_type=QuantType.QInt8)
        path = quantized
    del model
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def score(pairs):
        out = []
        for start in range(0, len(pairs), BATCH):
            batch = [list(p) for p in pairs[start:start + BATCH]]
            enc = tokenizer(batch, padding=True, truncation=True, max_length=max_length, return_tensors="np")
            out.append(session.run(None, {n: enc[n].astype(np.int64) for n in names})[0][:, 0])
        return np.concatenate(out)

    return score


# --- decoders ------------------------------------------------------------------------------------------------------

def llama_cpp(args, gguf: str):
    """llama.cpp's server with ``--reranking`` on a GGUF: one /rerank request per pass (one query, its passages), the
    scores, softmax([yes, no])[0], turned back into logit("yes") - logit("no")."""
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [args.llama_server, "-m", gguf, "--reranking", "-t", str(args.threads), "-tb", str(args.threads),
               "-c", "8192", "-np", "16", "-b", "512", "-ub", "512", "--host", "127.0.0.1", "--port", str(port)]
    log = open(Path(args.work) / "llama-server.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    _cleanup.append(server)
    deadline = time.time() + 600
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"llama-server did not start (see {log.name})")
        time.sleep(1)

    def score(pairs):
        query = pairs[0][0]
        if any(q != query for q, _ in pairs):
            raise ValueError("llama.cpp's /rerank takes one query per request: the pair file must hold one query")
        body = json.dumps({"query": query, "documents": [d for _, d in pairs], "top_n": len(pairs)}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/rerank", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as r:
            results = json.loads(r.read())["results"]
        scores = [0.0] * len(pairs)
        for item in results:
            p = min(max(float(item["relevance_score"]), 1e-30), 1 - 1e-16)
            scores[item["index"]] = math.log(p) - math.log1p(-p)
        return scores

    return score


_cleanup: list = []

ENGINES = {
    "st-fp32": lambda a: st(a, "float32"),
    "st-bf16": lambda a: st(a, "bfloat16"),
    "xenc_lab-fp32": lambda a: xenc_lab(a, "float32"),
    "xenc_lab-bf16": lambda a: xenc_lab(a, "bfloat16"),
    "xenc_lab-int8": lambda a: xenc_lab(a, None, "int8"),
    "xenc_lab-int8-fp32": lambda a: xenc_lab(a, "float32", "int8"),
    "openvino-f32": lambda a: openvino(a, "f32"),
    "openvino-bf16": lambda a: openvino(a, "bf16"),
    "openvino-int8": lambda a: openvino(a, None, int8=True),
    "onnxruntime-fp32": lambda a: onnxruntime(a),
    "onnxruntime-int8": lambda a: onnxruntime(a, int8=True),
    "llama.cpp-F32": lambda a: llama_cpp(a, a.gguf),
    "llama.cpp-BF16": lambda a: llama_cpp(a, a.gguf),
    "llama.cpp-Q8_0": lambda a: llama_cpp(a, a.gguf),
}


def main(argv=None) -> int:
    global args_threads
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", required=True, choices=sorted(ENGINES))
    parser.add_argument("--model", required=True, help="the checkpoint folder")
    parser.add_argument("--pairs", required=True, help="a .jsonl file of [query, passage] lists")
    parser.add_argument("--out", required=True, help="where the JSON result goes")
    parser.add_argument("--work", required=True, help="a folder for exports and logs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=64, help="pairs of the untimed first pass")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calibration", help="OpenVINO int8: a .jsonl of calibration pairs (not the timed ones)")
    parser.add_argument("--gguf", help="llama.cpp: the GGUF file")
    parser.add_argument("--llama-server", help="llama.cpp: the llama-server binary")
    args = parser.parse_args(argv)
    args_threads = args.threads
    _threads(args.threads)
    result = {"engine": args.engine, "pid": os.getpid(), "python": sys.version.split()[0]}
    try:
        pairs = _read_pairs(args.pairs)
        start = time.perf_counter()
        score = ENGINES[args.engine](args)
        score(pairs[: max(1, args.warmup)])
        result["setup_seconds"] = time.perf_counter() - start
        times, busy, out = [], [], None
        for _ in range(args.repeats):
            b0, t0 = _cpu_times()
            start = time.perf_counter()
            out = score(pairs)
            times.append(time.perf_counter() - start)
            b1, t1 = _cpu_times()
            busy.append((b1 - b0) / (t1 - t0) if t1 > t0 else float("nan"))
        result.update(pairs=len(pairs), seconds=times, busy_cpu=busy, scores=[float(x) for x in out],
                      versions=_versions(args.engine))
    except NotImplementedError as err:
        result["skipped"] = str(err)
    except Exception as err:  # a peer failing is a result to report, not a crash of the whole comparison
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
    finally:
        for process in _cleanup:
            process.terminate()
            process.wait(timeout=30)
    Path(args.out).write_text(json.dumps(result))
    return 0


def _versions(engine: str) -> dict:
    import importlib.metadata

    names = {"st": ["sentence-transformers", "transformers", "torch"], "xenc_lab": ["torch", "transformers"],
             "openvino": ["openvino", "nncf", "optimum-intel", "sentence-transformers", "transformers"],
             "onnxruntime": ["onnxruntime", "onnx", "torch", "transformers"], "llama.cpp": []}[engine.split("-")[0]]
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


args_threads = 2

if __name__ == "__main__":
    sys.exit(main())
