"""Every models.toml entry names a model localllm can run, and the real files are what it says.

An entry declares its `arch` (general.architecture) and `quant` (llama.cpp's file type); the
tensor types such a file holds are support.QUANT_MIXES[quant]. `pull` reads each real header
before its download all the same (test_pull.py): this test keeps the catalog itself honest.
"""

from __future__ import annotations

import pytest
from gguf.constants import GGMLQuantizationType
from real_models import MODEL_NAMES, model_path

from localllm import support
from localllm.gguf import read_gguf
from localllm.store import detect_quant, load_catalog

CATALOG = load_catalog()
# The test models' names in scripts/fetch-test-models -> their catalog entries.
TEST_MODEL_ENTRIES = {
    "smollm2-135m": "smollm2:135m",
    "gemma3-270m": "gemma3:270m",
    "qwen2.5-coder-0.5b": "qwen2.5-coder:0.5b",
}


@pytest.mark.parametrize("name", sorted(CATALOG.entries))
def test_every_catalog_entry_is_a_model_localllm_runs(name):
    entry = CATALOG.entries[name]
    assert entry.arch and entry.quant, f"{name}: give arch and quant"
    assert entry.quant in support.QUANT_MIXES, f"{name}: unknown quant {entry.quant}"
    assert support.missing_pieces(entry.arch, support.QUANT_MIXES[entry.quant]) == [], name


def test_the_mixes_name_real_ggml_types():
    names = {t.name for t in GGMLQuantizationType}
    for quant, types in support.QUANT_MIXES.items():
        assert types <= names, quant


def test_every_test_model_has_a_catalog_entry():
    assert sorted(TEST_MODEL_ENTRIES) == sorted(MODEL_NAMES)


@pytest.mark.parametrize("test_name", sorted(TEST_MODEL_ENTRIES))
def test_the_real_files_are_what_their_entries_say(test_name):
    entry = CATALOG.get(TEST_MODEL_ENTRIES[test_name])
    with read_gguf(model_path(test_name)) as gguf:
        types = {t.type_name for t in gguf.tensors.values()}
        assert gguf.architecture == entry.arch
        assert detect_quant(gguf.path, metadata=gguf.metadata) == entry.quant
    assert types <= support.QUANT_MIXES[entry.quant], types - support.QUANT_MIXES[entry.quant]
