"""evals/niah.py: prompt construction, scoring, and the harness plumbing on the built-in tiny
model (its weights are random, so its accuracy is ~0: what is checked is that the harness
runs, is deterministic, exercises the dense and the sparse prefill paths, and scores a model
that always answers correctly at 1.0)."""

import dataclasses
import json
import re

import pytest
import torch

from evals import niah
from kernels.config import SparseConfig
from model_executor.calibration import needle
from router.offline import GenerationResult
from model_executor.tokenizer import ByteTokenizer, HFTokenizer

# Small selection settings so that a 1K prompt has blocks to prune; alpha 1 keeps only the
# strongest block per tile besides the forced ones (the random tiny model's attention is flat).
SMALL = SparseConfig(block_size=64, sink_tokens=64, window_tokens=64)
NEEDLE_RE = re.compile(r"The special magic number for (\S+) is (\d{7})\.")


pytestmark = pytest.mark.usefixtures("one_thread")


def _word_tokenizer() -> HFTokenizer:
    """A word-level Hugging Face tokenizer built in memory (no chat template, no files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = set()
    for group in (needle.SUBJECTS, needle.VERBS, needle.OBJECTS, needle.TAILS, needle.CLAUSES, needle.ADJECTIVES,
                  needle.NOUNS, (niah.INSTRUCTION, niah.NEEDLE, niah.QUESTION, niah.ANSWER_PREFIX, "Answer:")):
        for text in group:
            words.update(re.findall(r"\w+|[^\w\s]", text))
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for w in sorted(words) + ["-"] + [str(d) for d in range(10)]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    return HFTokenizer(fast)


def _oracle(tokenizer, calls=None):
    """A stub ``generate``: reads the needle out of each prompt and answers with its value."""

    def generate(prompts, params, **kwargs):
        if calls is not None:
            calls.append(kwargs)
        out = []
        for i, ids in enumerate(prompts):
            found = NEEDLE_RE.findall(tokenizer.decode(ids))
            assert len(found) == 1, found
            answer = tokenizer.encode(f" {found[0][1]}.", add_bos=False)[: params.max_new_tokens]
            out.append(GenerationResult(f"gen-{i}", tuple(ids), tuple(answer), "stop"))
        return out

    return generate


@pytest.mark.parametrize("tok", [ByteTokenizer(), _word_tokenizer()], ids=["bytes", "hf-words"])
def test_prompts_fit_and_place_the_needle(tok):
    chat = niah.has_chat_template(tok)
    assert chat == isinstance(tok, ByteTokenizer)
    samples = niah.build_samples(tok, [600, 2000], niah.DEPTHS, 2, seed=5, chat=chat, answer_prefix=True)
    assert [(s.length, s.depth, s.trial) for s in samples] == [
        (n, d, t) for n in (600, 2000) for d in niah.DEPTHS for t in range(2)]
    for s in samples:
        assert s.length - 80 <= s.prompt_tokens <= s.length, (s.length, s.prompt_tokens)
        text = tok.decode(s.prompt_ids)
        if isinstance(tok, HFTokenizer):  # word-level decode puts spaces between all tokens
            text = re.sub(r"(?<=\d) (?=\d)", "", re.sub(r" ([.,?:])", r"\1", text)).replace(" - ", "-")
        assert NEEDLE_RE.findall(text) == [(s.key, s.value)]
        assert re.fullmatch(r"[a-z]+-[a-z]+", s.key) and re.fullmatch(r"[1-9]\d{6}", s.value)
        assert text.rstrip().endswith(niah.ANSWER_PREFIX.format(key=s.key))
        assert abs(s.needle_depth - s.depth) < (0.2 if s.length == 600 else 0.05)
        filler = text[text.index(niah.INSTRUCTION) + len(niah.INSTRUCTION):]
        assert not re.search(r"\d", NEEDLE_RE.sub("", filler))  # the only digits are the value
    for n in (600, 2000):
        for t in range(2):
            depth = [s.needle_depth for s in samples if s.length == n and s.trial == t]
            assert depth == sorted(depth) and depth[0] == 0.0 and depth[-1] == 1.0
    again = niah.build_samples(tok, [600, 2000], niah.DEPTHS, 2, seed=5, chat=chat, answer_prefix=True)
    assert again == samples
    other = niah.build_samples(tok, [600], niah.DEPTHS, 1, seed=6, chat=chat, answer_prefix=True)
    assert [s.prompt_ids for s in other] != [s.prompt_ids for s in samples[:5]]


def test_plain_prompt_without_chat_template():
    tok = ByteTokenizer()
    ids = niah.encode_prompt(tok, "ctx", "odd-otter", chat=False, answer_prefix=False)
    assert ids[0] == tok.bos_token_id and tok.decode(ids).endswith("Answer:")
    ids = niah.encode_prompt(tok, "ctx", "odd-otter", chat=True, answer_prefix=True)
    assert ids[-len("provided text is"):] == tok.encode("provided text is", add_bos=False)
    with pytest.raises(ValueError, match="cannot hold"):
        niah.build_sample(tok, niah.Haystack(tok, 0, 0), 100, 0.5, 0, 0, chat=True, answer_prefix=True)
    with pytest.raises(ValueError, match="cannot hold"):  # the answer's room counts
        niah.build_sample(tok, niah.Haystack(tok, 0, 0), 400, 0.5, 0, 0, chat=True, answer_prefix=True,
                          reserve=100)
    s = niah.build_sample(tok, niah.Haystack(tok, 0, 0), 800, 0.5, 0, 0, chat=True, answer_prefix=True,
                          reserve=32)
    assert s.length == 800 and 700 < s.prompt_tokens <= 768


def test_scoring():
    assert niah.is_correct("1234567", " 1234567.")
    assert niah.is_correct("1234567", "The number is 1234567")
    assert not niah.is_correct("1234567", "12345678")
    assert not niah.is_correct("1234567", "01234567")
    assert not niah.is_correct("1234567", "123456")


def test_modes():
    modes = niah.make_modes(SparseConfig(), [0.1, 0.2], "both")
    assert [m.name for m in modes] == ["dense", "sparse_a0.1", "sparse_a0.1_nocorr", "sparse_a0.2", "sparse_a0.2_nocorr"]
    assert modes[0].config.alpha == 0.0 and not modes[2].config.mean_correction
    assert [m.name for m in niah.make_modes(SparseConfig(), [0.05], "off")] == ["dense", "sparse_a0.05_nocorr"]
    with pytest.raises(ValueError):
        niah.make_modes(SparseConfig(), [0.0])


def test_oracle_scores_one_and_silent_model_zero(tiny):
    calls = []
    modes = niah.make_modes(SMALL, [0.1])
    payload = niah.run_niah(tiny, lengths=[500, 700], trials=2, modes=modes, max_new_tokens=12,
                            generate_fn=_oracle(tiny.tokenizer, calls), log=None)
    assert all(r["accuracy"] == 1.0 for r in payload["rows"])
    assert all(r["accuracy"] == 1.0 for r in payload["summary"])
    assert [c["sparse_config"].alpha for c in calls] == [0.0, 0.1, 0.1] * 2
    assert all(c["dense_below"] == 0 for c in calls)

    def silent(prompts, params, **kwargs):
        return [GenerationResult(f"g{i}", tuple(p), (), "length") for i, p in enumerate(prompts)]

    payload = niah.run_niah(tiny, lengths=[500], trials=1, modes=modes, generate_fn=silent, log=None)
    assert all(r["accuracy"] == 0.0 for r in payload["rows"])


def test_kv_budget_splits_generate_calls(tiny):
    calls = []
    modes = niah.make_modes(SMALL, [0.1], "on")
    bpt = niah.kv_bytes_per_token(tiny)
    budget = 2.5 * (600 + 4) * bpt / 2**30  # two prompts per call
    niah.run_niah(tiny, lengths=[600], trials=1, modes=modes, max_new_tokens=4, kv_budget_gb=budget,
                  generate_fn=_oracle(tiny.tokenizer, calls), log=None)
    assert len(calls) == 2 * 3  # 5 depths -> groups of 2, 2, 1; two modes


def test_tiny_model_end_to_end(tiny):
    modes = niah.make_modes(SMALL, [1.0], "both")
    kwargs = dict(lengths=[1024], depths=[0.0, 0.5, 1.0], trials=1, modes=modes, max_new_tokens=6, seed=3, log=None)
    payload = niah.run_niah(tiny, **kwargs)
    names = ["dense", "sparse_a1", "sparse_a1_nocorr"]
    assert [m["name"] for m in payload["modes"]] == names
    assert len(payload["rows"]) == 3 * 3 and len(payload["summary"]) == 3 and len(payload["samples"]) == 3
    for r in payload["rows"]:
        assert r["trials"] == 1 and 0.0 <= r["accuracy"] <= 1.0 and 900 < r["mean_prompt_tokens"] <= 1024 - 6
    dens = {d["mode"]: d for d in payload["density"]}
    # dense: every block; sparse: the index pruned (both prefill paths ran, one index call per layer)
    assert dens["dense"]["alphas_seen"] == [0.0] and dens["dense"]["density"] == 1.0  # by definition
    for m in names[1:]:
        assert dens[m]["alphas_seen"] == [1.0] and 0.0 < dens[m]["density"] < 0.9
    assert all(d["index_calls"] == tiny.num_layers for d in payload["density"])
    for s in payload["samples"]:
        assert set(s["outputs"]) == set(names) and all(isinstance(o, str) for o in s["outputs"].values())
    again = niah.run_niah(tiny, **kwargs)
    for key in ("rows", "summary", "density", "samples"):
        assert again[key] == payload[key], key
    json.dumps(payload)  # serialisable as is


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "niah.json"
    niah.main(["--model", "builtin:tiny", "--device", "cpu", "--lengths", "512", "--depths", "0", "100",
               "--alphas", "1.0", "--correction", "on", "--max-new-tokens", "3", "--block-size", "64",
               "--sink", "64", "--window", "64", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["environment"]["torch"] == torch.__version__
    assert saved["settings"]["depths"] == [0.0, 1.0] and saved["settings"]["chat_template"] is True
    assert [m["name"] for m in saved["modes"]] == ["dense", "sparse_a1"]
    assert saved["modes"][1]["config"]["block_size"] == 64
    printed = capsys.readouterr().out
    assert "wrote" in printed and printed.rstrip().splitlines()[-1].split()[1] == "dens."


def test_harness_errors(tiny):
    tok = tiny.tokenizer
    with pytest.raises(ValueError, match="depth"):
        niah.build_sample(tok, niah.Haystack(tok, 0, 0), 1000, 1.5, 0, 0, chat=True, answer_prefix=True)
    with pytest.raises(ValueError, match="trials"):
        niah.run_niah(tiny, lengths=[600], trials=0, log=None)
    with pytest.raises(ValueError, match="correction"):
        niah.make_modes(SparseConfig(), [0.1], "maybe")
    no_tok = dataclasses.replace(tiny, tokenizer=None)
    with pytest.raises(ValueError, match="tokenizer"):
        niah.run_niah(no_tok, lengths=[600], log=None)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        niah.run_niah(tiny, lengths=[65536], log=None)
    with pytest.raises(SystemExit, match="depths"):
        niah.main(["--model", "builtin:tiny", "--depths", "150"])
