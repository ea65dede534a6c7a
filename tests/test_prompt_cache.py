"""The prompt cache on disk: a prompt seen before is read back, not prefilled, and the answer is
the same; a damaged file is ignored (and removed), a full disk loses only the file."""

import errno

import pytest
from real_models import model_path

from localllm import prompt_cache
from localllm.conversation import Conversation
from localllm.models import load_model
from localllm.options import Options

GREEDY = Options(temperature=0.0, num_predict=12)
TEXT = " ".join(f"Item {i} of the list is the colour number {i * 7 % 11}." for i in range(25))


def answer(prompt: str = TEXT + "\nWhich colour has item 3?") -> tuple[str, int]:
    """(reply, prompt tokens read back from the prompt cache) of a fresh process's one shot."""
    model = load_model(model_path("smollm2-135m"), n_ctx=1024, device="cpu")
    try:
        conversation = Conversation(model, options=GREEDY)
        conversation.use_prompt_cache()
        ids, _ = conversation.ask(prompt)
        responses = list(conversation.generate(ids))
        return "".join(r.text for r in responses), responses[-1].cached_tokens
    finally:
        model.close()


def test_a_prompt_seen_before_is_read_back_with_the_same_answer():
    first, cached = answer()
    assert cached == 0
    files = list(prompt_cache.cache_dir().glob("*.kv"))
    assert len(files) == 1
    again, cached = answer()
    assert again == first
    assert cached > 250  # all of the prompt but its last token
    # a new question about the same text reuses the text's positions
    _, cached = answer(TEXT + "\nWhich colour has item 9?")
    assert cached > 250
    # it branches off the first file's tokens, so both are kept
    assert len(list(prompt_cache.cache_dir().glob("*.kv"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_file_is_ignored_and_removed(damage):
    first, _ = answer()
    (path,) = prompt_cache.cache_dir().glob("*.kv")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"x" * 1000)
    again, cached = answer()
    assert (again, cached) == (first, 0)
    assert path.exists()  # rewritten after the answer, whole
    assert path.stat().st_size == len(data)


def test_a_full_disk_loses_only_the_file(monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prompt_cache.os, "replace", full)
    first, _ = answer()
    assert not list(prompt_cache.cache_dir().glob("*"))  # no file, no temporary left
    monkeypatch.undo()
    assert answer()[0] == first


def test_the_cap_removes_the_least_recently_used(monkeypatch):
    answer()
    (one,) = prompt_cache.cache_dir().glob("*.kv")
    monkeypatch.setenv("LOCALLLM_PROMPT_CACHE_BYTES", str(one.stat().st_size + 1))
    answer("Something else. " + TEXT)
    (left,) = prompt_cache.cache_dir().glob("*.kv")
    assert left != one
