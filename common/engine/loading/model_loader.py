"""Load a checkpoint (Hugging Face directory or GGUF file) into a ``DecoderModel``."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from common.engine.loading.gguf_blocks import SourceWeights
from common.engine.loading.prepack_cache import PrepackCache
from common.engine.model_config import ModelConfig, load_model_config
from common.engine.models.quantization_scheme import NO_QUANTIZATION, Quantization
from common.engine.models.decoder import SINGLE, DecoderModel
from common.engine.parallel.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)


def load_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    files = sorted(checkpoint.glob("*.safetensors"))  # (a GGUF's kept blocks lie in a folder below)
    if not files:
        raise ValueError(f"checkpoint {str(checkpoint)!r} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as weights:
                for name in tqdm(list(weights.keys()), desc=f"loading {file.name}", unit="tensor", leave=False,
                                 disable=len(files) == 1 and file.stat().st_size < 64 << 20):
                    state[name] = weights.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"weights file {str(file)!r} is corrupt or unreadable: {exc}") from None
    return state


def load_model(checkpoint: Path, dtype: torch.dtype, device: torch.device,
               random_weights: bool = False, tp: TensorParallel = SINGLE,
               quantization: Quantization = NO_QUANTIZATION) -> tuple[DecoderModel, ModelConfig]:
    """Build the model for ``checkpoint`` and load its weights; errors name the missing pieces.
    ``random_weights``: only config.json is read (see ``random_model``).  ``tp``: this rank's
    share of the model only (the config returned is the whole model's).  ``quantization``: how
    the loaded weights are stored (quantized on load)."""
    cfg = load_model_config(checkpoint)
    if random_weights:
        return random_model(cfg, dtype, device, tp=tp, quantization=quantization), cfg
    state = load_state_dict(checkpoint)
    # Multimodal Gemma 3 checkpoints keep the text model under another prefix.
    state = {k.removeprefix("language_model."): v for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = tp.shard_state_dict(state, cfg)
    with torch.device("meta"):
        model = DecoderModel(tp.local_config(cfg), tp)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"checkpoint {str(checkpoint)!r} lacks weights: {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if k in expected}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"checkpoint {str(checkpoint)!r} does not match its config.json: {exc}") from None
    source = SourceWeights.of_checkpoint(checkpoint) if quantization.enabled else None
    if source is not None and tp.size > 1:
        log.info("tensor parallelism: a GGUF's 4-bit blocks are not kept (each rank quantizes its share)")
        source = None
    cache = (PrepackCache.for_checkpoint(checkpoint, quantization, dtype, tp.rank, tp.size)
             if quantization.enabled and device.type == "cpu" else None)
    model.finish_loading(device, quantization, source, prepacked=cache.load() if cache else None)
    if cache is not None and not model.used_prepacked:
        cache.save(model.quantized_weights())
    if source is not None and not model.used_prepacked:
        log.info("%s", source.summary(quantization.scheme))
    return model.eval(), cfg


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 tp: TensorParallel = SINGLE, quantization: Quantization = NO_QUANTIZATION) -> DecoderModel:
    """A model of ``cfg``'s shape with random weights made in place on ``device`` (normal, std 0.02;
    norms one, biases zero): an 8B shape costs no download, no disk and no host memory."""
    with torch.device("meta"):
        model = DecoderModel(tp.local_config(cfg), tp)
    model = model.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0 - cfg.norm_weight_offset)  # Gemma's (1 + w) folds in after loading
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.finish_loading(device, quantization)
    return model.eval()
