"""The peers driver: writes the held-out pairs once, runs each engine in its own process (scripts/peers/worker.py)
in its own environment, reads their JSON results back and writes reports/peers.md."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .stats import EngineResult, parse_result
from .venvs import ensure_venv

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = ROOT / "scripts" / "peers"
# xenc_lab-int8 has bf16 around its int8 layers; xenc_lab-int8-fp32 float32, where they rotate their inputs.
ENCODER_ENGINES = ("st-fp32", "st-bf16", "xenc_lab-fp32", "xenc_lab-bf16", "xenc_lab-int8", "xenc_lab-int8-fp32",
                   "onnxruntime-fp32", "onnxruntime-int8", "openvino-f32", "openvino-bf16", "openvino-int8")
DECODER_ENGINES = ("st-fp32", "xenc_lab-fp32", "xenc_lab-bf16", "xenc_lab-int8", "xenc_lab-int8-fp32", "llama.cpp-F32",
                   "llama.cpp-BF16", "llama.cpp-Q8_0")
GGUF_TYPES = {"llama.cpp-F32": "f32", "llama.cpp-BF16": "bf16", "llama.cpp-Q8_0": "q8_0"}
# Held-out seeds: no other benchmark, test or tuning step draws the workload with these.
SEED, CALIBRATION_SEED = 4545, 4546


def encoder_lists(n_queries: int, per_query: int, seed: int = SEED) -> list[tuple[str, str]]:
    """``n_queries`` query lists of ``per_query`` passages each, consecutive: the 'mixed' workload's texts."""
    from ..workloads import make_pairs

    queries = [q for q, _ in make_pairs("mixed", n_queries, seed=seed)]
    passages = [d for _, d in make_pairs("mixed", n_queries * per_query, seed=seed + 1000)]
    return [(q, passages[i * per_query + j]) for i, q in enumerate(queries) for j in range(per_query)]


def write_pairs(path: Path, pairs) -> Path:
    path.write_text("".join(json.dumps(list(p)) + "\n" for p in pairs), encoding="utf-8")
    return path


def _python_with(module: str, requirements: str, log) -> str:
    """This interpreter where ``module`` imports, else the venv built from scripts/peers/``requirements``."""
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    return str(ensure_venv(SCRIPTS / requirements, log))


def _python_for(engine: str, log) -> str:
    """The interpreter an engine runs in: OpenVINO's own venv; ONNX Runtime's where this one lacks it; else this one."""
    if engine.startswith("openvino"):
        return str(ensure_venv(SCRIPTS / "openvino.txt", log))
    if engine.startswith("onnxruntime"):
        return _python_with("onnxruntime", "onnxruntime.txt", log)
    return sys.executable


def run_engine(engine: str, model: Path, pairs: Path, work: Path, args, log, extra=(), python=None) -> EngineResult:
    """One worker process for ``engine``; its result (a failure to start or a timeout is an error result)."""
    out = work / f"{engine}.json"
    out.unlink(missing_ok=True)
    folder = work / engine
    folder.mkdir(parents=True, exist_ok=True)
    try:
        python = python or _python_for(engine, log)
    except subprocess.CalledProcessError as err:
        return EngineResult(engine, error=f"its environment did not build: {err}")
    command = [python, str(SCRIPTS / "worker.py"), "--engine", engine, "--model", str(model), "--pairs", str(pairs),
               "--out", str(out), "--work", str(folder), "--repeats", str(args.repeats), "--threads", str(args.threads),
               "--warmup", str(extra.get("warmup", 64)), *extra.get("argv", [])]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    log(f"{engine}: running ({Path(python).parent.parent.name})")
    try:
        done = subprocess.run(command, env=env, timeout=args.timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return EngineResult(engine, error=f"timed out after {args.timeout} s")
    if not out.exists():
        return EngineResult(engine, error=f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
    result = parse_result(json.loads(out.read_text()))
    log(f"{engine}: " + (f"{result.pairs_per_s:.2f} pairs/s" if result.ok else result.skipped or result.error))
    return result


def llama_cpp(log) -> Path:
    """llama.cpp's build folder, built once (scripts/peers/build_llama_cpp.sh) under the cache."""
    log("llama.cpp: llama-server from the cache, or built there once (about 10 minutes on 2 idle cores)")
    done = subprocess.run(["bash", str(SCRIPTS / "build_llama_cpp.sh"), sys.executable], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp did not build: {done.stderr.strip()[-400:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def gguf(build: Path, model: Path, outtype: str, log) -> Path:
    """The GGUF of ``model`` in ``outtype``, converted once beside the build. The converter knows a Qwen3 reranker by
    its folder's name, so it reads the checkpoint through a folder of links named qwen3-reranker-*."""
    target = build / "gguf" / f"{model.name}-{outtype}.gguf"
    if target.exists():
        return target
    named = build / "gguf" / f"qwen3-reranker-{model.name}"
    named.mkdir(parents=True, exist_ok=True)
    for item in model.iterdir():
        link = named / item.name
        if not link.exists():
            link.symlink_to(item.resolve())
    log(f"llama.cpp: converting {model.name} to {outtype}")
    partial = target.with_suffix(".partial")
    python = _python_with("sentencepiece", "llama-cpp.txt", log)
    done = subprocess.run([python, str(SCRIPTS / "convert_gguf.py"), str(build / "src"), str(named),
                           str(partial), outtype], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the GGUF conversion failed: {done.stderr.strip()[-400:]}")
    partial.rename(target)
    return target


def _decoder_results(args, work: Path, log) -> tuple[list[EngineResult], str, dict]:
    """The decoder engines on one query's ``args.decoder_passages`` passages; the note of what did not run."""
    from ..decoder import decoder_reranker, rerank_pairs

    model = decoder_reranker(args.decoder_model)
    pairs = write_pairs(work / "decoder-pairs.jsonl", rerank_pairs(args.decoder_passages, seed=SEED))
    extra = {"warmup": args.decoder_warmup}
    results, note = [], ""
    engines = [e for e in DECODER_ENGINES if _wanted(e, args)]
    server = None
    if any(e in GGUF_TYPES for e in engines):
        try:
            build = llama_cpp(log)
            server = str(build / "build" / "bin" / "llama-server")
        except (RuntimeError, OSError, IndexError) as err:
            note = f"llama.cpp did not run: {err}"
            log(note)
    for engine in engines:
        if engine in GGUF_TYPES:
            if server is None:
                results.append(EngineResult(engine, skipped=note))
                continue
            try:
                path = gguf(build, model, GGUF_TYPES[engine], log)
            except (RuntimeError, OSError) as err:
                results.append(EngineResult(engine, error=str(err)))
                continue
            extra = {"warmup": args.decoder_warmup, "argv": ["--gguf", str(path), "--llama-server", server]}
        results.append(run_engine(engine, model, pairs, work / "decoder", args, log, extra))
    return results, note, {"model": model.name, "pairs": pairs}


def _wanted(engine: str, args) -> bool:
    return not args.engines or any(engine.startswith(e) for e in args.engines)


def main(argv=None) -> int:
    from .report import kept_sections, write_report

    parser = argparse.ArgumentParser(prog="python -m xenc_lab.bench.peers", description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=8, help="encoder query lists")
    parser.add_argument("--per-query", type=int, default=32, help="passages per encoder query list")
    parser.add_argument("--decoder-passages", type=int, default=32, help="the decoder's one query's passages")
    parser.add_argument("--decoder-model", default="qwen3-0.6b", help="xenc_lab.bench.decoder.MODELS name")
    parser.add_argument("--warmup", type=int, default=64, help="pairs of an encoder engine's untimed pass")
    parser.add_argument("--decoder-warmup", type=int, default=4, help="pairs of a decoder engine's untimed pass")
    parser.add_argument("--calibration", type=int, default=128, help="OpenVINO int8's calibration pairs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds one engine may take")
    parser.add_argument("--engines", nargs="*", help="only engines whose names start with these")
    parser.add_argument("--no-decoder", action="store_true",
                        help="encoders only (the report keeps an earlier run's decoder part, marked as such)")
    parser.add_argument("--no-encoder", action="store_true", help="decoders only (likewise)")
    parser.add_argument("--report", default=str(ROOT / "reports" / "peers.md"))
    parser.add_argument("--note", default="", help="a sentence for the report about the machine's state")
    args = parser.parse_args(argv)
    for name in ("queries", "per_query", "decoder_passages", "calibration", "repeats", "threads"):
        if getattr(args, name) < (2 if name in ("per_query", "decoder_passages") else 1):
            parser.error(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    from ...zoo import minilm_cross_encoder

    load = [os.getloadavg()[0]]
    sections = {}
    with tempfile.TemporaryDirectory(prefix="xenc-peers-") as tmp:
        work = Path(tmp)
        if not args.no_encoder:
            model = minilm_cross_encoder()
            pairs = write_pairs(work / "encoder-pairs.jsonl", encoder_lists(args.queries, args.per_query))
            calibration = write_pairs(work / "calibration.jsonl", encoder_lists(
                max(1, args.calibration // args.per_query), args.per_query, seed=CALIBRATION_SEED))
            results = []
            for engine in (e for e in ENCODER_ENGINES if _wanted(e, args)):
                extra = {"warmup": args.warmup}
                if engine == "openvino-int8":
                    extra["argv"] = ["--calibration", str(calibration)]
                results.append(run_engine(engine, model, pairs, work / "encoder", args, print, extra))
            sections["encoder"] = (results, [args.per_query] * args.queries, {"model": model.name, "pairs": pairs})
            load.append(os.getloadavg()[0])
        if not args.no_decoder:
            results, note, meta = _decoder_results(args, work, print)
            sections["decoder"] = (results, [args.decoder_passages], meta | {"note": note})
            load.append(os.getloadavg()[0])
        left_out = [name for name, off in (("encoder", args.no_encoder), ("decoder", args.no_decoder)) if off]
        sections = kept_sections(Path(args.report), left_out) | sections
        write_report(Path(args.report), sections, args, load)
    print(f"wrote {args.report}")
    return 0
