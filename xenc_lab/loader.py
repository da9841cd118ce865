"""Find a checkpoint, build our module for its architecture and load its safetensors weights into it."""
from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from . import choices as engine_choices
from .choices import Choices
from .cpu.heap import keep_freed_batches
from .cpu.int8 import int8_route, quantize_linears
from .cpu.norm import row_layer_norms
from .cpu.prepacked import prepack_linears
from .models import ARCHITECTURES, PackedModel

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that hold no weights: position id buffers written by old transformers.
_IGNORED_SUFFIXES = ("position_ids",)
INT8_ON_TORCH_OPS = (
    "quantization='int8' runs on torch's int8 ops on this CPU: correct, but slower than float32. xenc_lab's int8 "
    "GEMM needs int8 dot products: AVX512-VNNI, AMX-INT8 or AVX-VNNI (docs/int8.md, 'Where int8 is fast')."
)
_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*", "*.jinja"]


def resolve(model_name_or_path: str | os.PathLike) -> Path:
    """A local directory, or a hub id found through huggingface_hub's cache (offline once cached)."""
    if not isinstance(model_name_or_path, (str, os.PathLike)):
        raise TypeError(f"model_name_or_path must be a str or path, got {type(model_name_or_path).__name__}")
    path = Path(model_name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"expected a model directory or a hub id, got the file {str(path)!r}")
    from huggingface_hub import constants, snapshot_download

    # Online, the hub is asked first, as transformers and sentence-transformers do (a cached copy may lack files that
    # an earlier download of some of them left out); the cache answers when the hub cannot, and offline. Only the
    # first answer's error is reported.
    error = None
    for local_files_only in ([True] if constants.HF_HUB_OFFLINE else [False, True]):
        try:
            return Path(snapshot_download(str(model_name_or_path), allow_patterns=_FILES, local_files_only=local_files_only))
        except Exception as err:  # noqa: BLE001 (not found, no network, not a valid id: each is reported alike)
            error = error or err
    offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
    reason = " ".join(str(error).split())  # one line: the hub's messages span several
    raise ValueError(
        f"{str(model_name_or_path)!r} is neither a local model directory nor a hub id that could be "
        f"downloaded{offline} or found in the huggingface_hub cache ({type(error).__name__}: {reason}). To load a "
        "model without the hub, pass the path of its directory (config.json, model.safetensors and the tokenizer's "
        "files), e.g. one saved by CrossEncoder.save_pretrained or fetched once with huggingface_hub.snapshot_download"
    ) from error


def load_config(path: Path, trust_remote_code: bool = False, **config_kwargs) -> PretrainedConfig:
    """The model's config, with a CrossEncoder save's config arguments (``config_kwargs``) as CrossEncoder applies them."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"no config.json in {path}: expected a model directory (config.json, model.safetensors and "
                         "the tokenizer's files)")
    try:
        return AutoConfig.from_pretrained(path, **config_kwargs, trust_remote_code=trust_remote_code)
    except OSError as err:  # transformers' word for an unreadable file
        raise ValueError(f"{Path(path) / 'config.json'} could not be read: {err}") from err


def architecture_of(config: PretrainedConfig) -> str:
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError(f"config.json names no architecture (model_type {config.model_type!r})")
    return archs[0]


def family_of(config: PretrainedConfig) -> type[PackedModel]:
    """The packed model class of the config's architecture (``models.ARCHITECTURES``): its contract, encoder or
    decoder, and what its family declares before any weight is read."""
    arch = architecture_of(config)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"architecture {arch!r} is not supported by the packed engine; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[arch]


def build_model(config: PretrainedConfig) -> PackedModel:
    family = family_of(config)
    with torch.device("meta"):
        model = family(config)
    return model


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint in ``path``, as transformers finds them: ``model.safetensors``, else
    the shards ``model.safetensors.index.json`` names. Other .safetensors files in the folder (an old copy, an
    adapter) are not the model's weights and are never read."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [name for name in shards if not (path / name).is_file()]
        if not shards or missing:
            raise ValueError(f"{index} names {'no shards' if not shards else 'shards not in ' + str(path)}: {missing}")
        return [path / name for name in shards]
    others = sorted(p.name for p in path.glob("*.safetensors"))
    found = sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"})
    raise ValueError(
        f"no model.safetensors (or model.safetensors.index.json) in {path}; only safetensors are loaded"
        + (f" (found {', '.join(others)}: name the model's weights model.safetensors)" if others else "")
        + (f" (found {', '.join(found)}: convert them to safetensors)" if found else "")
    )


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    files = checkpoint_files(path)
    tensors = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as err:  # safetensors' own errors name neither the file nor a remedy
            raise ValueError(f"{file} is not a readable safetensors file ({type(err).__name__}: {err}): it is "
                             "truncated (an interrupted download?) or corrupt; download or save it again") from err
    return tensors


def _canonical(name: str) -> str:
    # Old TF-converted checkpoints name LayerNorm parameters gamma/beta.
    if name.endswith(".gamma"):
        return name[: -len("gamma")] + "weight"
    if name.endswith(".beta"):
        return name[: -len("beta")] + "bias"
    return name


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Every module parameter must come from the checkpoint. Checkpoint tensors the model has no use for
    (transformers ignores them too) are reported, not loaded."""
    params = dict(model.named_parameters())
    tensors = {_canonical(k): v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
    missing = sorted(set(params) - set(tensors))
    unused = sorted(set(tensors) - set(params))
    shapes = [f"{name}: checkpoint {tuple(tensors[name].shape)}, config {tuple(param.shape)}"
              for name, param in params.items() if name in tensors and tuple(param.shape) != tuple(tensors[name].shape)]
    if missing or shapes:
        few = lambda items: f"{items[:8]}{f' and {len(items) - 8} more' if len(items) > 8 else ''}"
        problems = ([f"missing tensors {few(missing)}"] if missing else []) + (
            [f"tensors whose shapes differ from the config's {few(shapes)}"] if shapes else [])
        raise ValueError(f"the checkpoint does not match its config.json ({type(model).__name__}): "
                         + "; ".join(problems))
    if unused:
        logger.warning("checkpoint tensors not used by %s: %s", type(model).__name__, ", ".join(unused[:16]))
        tensors = {k: v for k, v in tensors.items() if k in params}
    model.load_state_dict(tensors, strict=False, assign=True)


def load_model(
    path: Path, config: PretrainedConfig, device: torch.device, dtype: torch.dtype, compile: bool = False,
    quantization: str | None = None,
) -> tuple[PackedModel, Choices]:
    """The packed model with the checkpoint's weights, ready to run, and the engine's choices for it, made once here.
    On the CPU the linears take their GEMM routes' weight layouts (``cpu.prepacked``; in float32 but those that see
    one row per pair) and 16-bit LayerNorms xenc_lab's row kernel. With ``quantization="int8"`` the linears become
    int8 layers first (``cpu.int8``), but those that see one row per pair, which stay at ``dtype`` (docs/int8.md)."""
    model = build_model(config)
    tensors = read_checkpoint(path)
    with torch.device("meta"):
        model.before_load(set(tensors))
    load_weights(model, tensors)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.after_load()
    choices = engine_choices.resolve(device, dtype, model.head_shape(), compile, model.causal, quantization)
    if device.type == "cpu":
        keep_freed_batches()
        if quantization == "int8":
            if int8_route() == "torch":
                warnings.warn(INT8_ON_TORCH_OPS, stacklevel=2)
            # the per-pair linears stay at dtype: quantizing them puts rounding straight onto the score
            quantize_linears(model, keep=model.per_pair_linears(), rotate=True)
        prepack_linears(model, choices, keep=model.per_pair_linears() if dtype == torch.float32 else ())
        row_layer_norms(model)
    return model, choices
