"""The dequantized-GGUF cache is keyed by the file's content, not its path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbserve import models


@pytest.fixture
def builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The GGUF files the cache was built from, in order (the dequantization itself stubbed out)."""
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    done: list[Path] = []

    def write(gguf_path: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(gguf_path.read_bytes())
        done.append(gguf_path)

    monkeypatch.setattr(models, "_write_dequantized", write)
    return done


def _gguf(folder: Path, content: bytes) -> Path:
    folder.mkdir(parents=True)
    path = folder / "tiny.gguf"
    path.write_bytes(content)
    return path


def test_the_same_file_at_another_path_reuses_the_cache(tmp_path: Path, builds: list[Path]) -> None:
    """Two virtualenvs (a checkout and CI's clean clone) hold the same wheel's file at two paths:
    the second loads the first one's cache instead of rebuilding it."""
    first = _gguf(tmp_path / "venv-a", b"GGUF same bytes")
    second = _gguf(tmp_path / "venv-b", b"GGUF same bytes")
    folder = models._cached_gguf_folder("tiny", first)
    assert models._cached_gguf_folder("tiny", second) == folder
    assert builds == [first]
    assert json.loads((folder / models.SOURCE_FILE).read_text())["size"] == len(b"GGUF same bytes")


def test_another_file_of_the_same_name_rebuilds_the_cache(tmp_path: Path, builds: list[Path]) -> None:
    first = _gguf(tmp_path / "a", b"GGUF one model")
    other = _gguf(tmp_path / "b", b"GGUF another!!")  # same size, other content
    folder = models._cached_gguf_folder("tiny", first)
    assert models._cached_gguf_folder("tiny", other) == folder
    assert builds == [first, other]
    assert (folder / "model.safetensors").read_bytes() == b"GGUF another!!"
