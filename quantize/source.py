"""Finding and checking the checkpoint to convert: a local folder or a Hugging Face Hub repo id."""

from __future__ import annotations

import json
from pathlib import Path

from quantize.errors import QuantizeError

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

# What a conversion reads from a Hub repo; weights only as safetensors, so nothing can execute code.
_HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "*.jinja"]


def resolve_source(src: str) -> tuple[Path, str]:
    """The local checkpoint folder for `src` (the folder itself, or a Hub repo downloaded to the
    HF cache) and the model's name (the folder's or the repo's, not the cache's snapshot hash)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path, path.resolve().name
    if path.suffix == ".gguf" or path.is_file():
        raise QuantizeError(f"{src} is a file; pass a Hugging Face checkpoint folder (config.json, *.safetensors)")
    if src.count("/") == 1 and not src.startswith((".", "/", "~")):
        return _download(src), src.split("/")[1]
    raise QuantizeError(f"{src} is neither a checkpoint folder nor a Hugging Face repo id (owner/name)")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError:
        raise QuantizeError("huggingface_hub is not installed; download the checkpoint and pass its folder") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except RepositoryNotFoundError:
        raise QuantizeError(f"no Hugging Face repo {repo_id} (or it is gated: log in with `hf auth login`)") from None
    except LocalEntryNotFoundError:
        raise QuantizeError(f"{repo_id} is not in the Hugging Face cache and downloads are off (HF_HUB_OFFLINE)") from None
    except (HfHubHTTPError, OSError) as exc:
        raise QuantizeError(f"cannot download {repo_id}: {str(exc).splitlines()[0]}") from None


def read_config(folder: Path) -> dict:
    """config.json of a checkpoint folder, after checking the folder has weights we are willing to read."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise QuantizeError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    if not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise QuantizeError(
                f"{folder} has only pickle weights ({pickles[0]}); edgechat reads safetensors only, because "
                "pickle files can run code when loaded. Use a safetensors version of the model"
            )
        raise QuantizeError(f"{folder} has no *.safetensors weights")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise QuantizeError(f"{folder} has no tokenizer.json or tokenizer.model; download the tokenizer files too")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QuantizeError(f"cannot read {config_file}: {exc}") from None
    if not isinstance(config, dict):
        raise QuantizeError(f"{config_file} is not a JSON object")
    # multimodal configs keep the language model's settings under text_config
    if "text_config" in config and "hidden_size" not in config:
        config = {**config, **config["text_config"], "architectures": config.get("architectures")}
    return config
