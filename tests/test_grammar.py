"""Constrained decoding (model_executor/grammar.py) on the built-in tiny model: every output of a
greedy or sampled loop (prefill, then decode; fill_mask, sample, accept) must satisfy its spec,
checked by independent parsers (json, jsonschema, re); plus the masks' exact contents on small
grammars, every error path, the cache, and an in-memory byte-level BPE Hugging Face tokenizer."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch

from model_executor import grammar
from model_executor.grammar import (
    GrammarCache,
    Guide,
    compile_guide,
    fill_masks,
    response_format_to_guided,
    validate_guided,
    warm_tokenizer,
)
from model_executor.runner import PrefillItem
from model_executor.tokenizer import ByteTokenizer, HFTokenizer, IdTokenizer

EOS, END = 257, 262  # the byte tokenizer's stop tokens


def _prompt(gen: torch.Generator) -> str:
    n = int(torch.randint(3, 24, (1,), generator=gen))
    return bytes(torch.randint(32, 127, (n,), generator=gen).tolist()).decode()


def _generate(tiny, guided, prompt, *, max_tokens=160, temperature=0.0, seed=0, bias=None):
    """Our own small decode loop: returns (token ids, text, guide)."""
    loaded, runner = tiny
    tok = loaded.tokenizer
    guide = compile_guide(guided, tok)
    gen = torch.Generator().manual_seed(seed)
    ids = tok.encode(prompt)
    runner.ensure_capacity("g", len(ids) + max_tokens + 1)
    out: list[int] = []
    try:
        logits = runner.prefill([PrefillItem("g", ids)])[0]
        for _ in range(max_tokens):
            logits = logits.clone()
            if bias is not None:
                logits += bias
            guide.fill_mask(logits)
            if temperature == 0:
                t = int(logits.argmax())
            else:
                t = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            guide.accept(t)
            out.append(t)
            if guide.is_terminated():
                break
            logits = runner.decode(["g"], [t])[0]
    finally:
        runner.pool.release("g")
    return out, tok.decode(out), guide


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 99},
                   "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "scores", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature,seeds", [(0.0, [11]), (1.0, [21, 22, 23, 24])])
def test_json_schema_outputs_validate(tiny_runner, temperature, seeds):
    gen = torch.Generator().manual_seed(101)
    for seed in seeds:
        _, text, guide = _generate(tiny_runner, {"type": "json_schema", "schema": SCHEMA, "strict": True},
                                   _prompt(gen), temperature=temperature, seed=seed)
        assert guide.is_terminated(), text
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])  # the schema's order


def test_json_object_outputs_parse(tiny_runner):
    # a random model rarely closes a string by itself: favour the closing characters and the
    # stop tokens (a sampler's choice; the grammar alone decides what is valid)
    bias = torch.zeros(264)
    bias[[ord('"'), ord("}"), ord("]"), EOS, END]] = 6.0
    gen = torch.Generator().manual_seed(102)
    for seed in (31, 32, 33):
        _, text, guide = _generate(tiny_runner, {"type": "json_object"}, _prompt(gen), temperature=1.0, seed=seed,
                                   bias=bias, max_tokens=300)
        assert guide.is_terminated(), text
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("pattern", [r"[a-z]{2,5}-\d{3}", r"(ab|cd)+x?", r"\d+\.\d{2}", r"(yes|no) [A-Z][a-z]{0,4}"])
def test_regex_outputs_fullmatch(tiny_runner, pattern):
    gen = torch.Generator().manual_seed(103)
    bias = torch.zeros(264)
    bias[[EOS, END]] = 3.0  # the unbounded patterns end sooner
    for temperature, seed in ((0.0, 41), (1.0, 42), (1.0, 43)):
        _, text, guide = _generate(tiny_runner, {"type": "regex", "pattern": pattern}, _prompt(gen),
                                     temperature=temperature, seed=seed, bias=bias)
        assert guide.is_terminated(), text
        assert re.fullmatch(pattern, text, re.ASCII), (pattern, text)


def test_choice_outputs_are_choices(tiny_runner):
    choices = ["yes", "no", "maybe so", 'a "quoted" \\ choice', "ünïcødé ✓"]
    gen = torch.Generator().manual_seed(104)
    seen = set()
    for temperature, seed in ((0.0, 51), *((1.0, s) for s in range(52, 60))):
        _, text, guide = _generate(tiny_runner, {"type": "choice", "choices": choices}, _prompt(gen),
                                   temperature=temperature, seed=seed)
        assert guide.is_terminated()
        assert text in choices
        seen.add(text)
    assert len(seen) >= 2  # sampling reaches more than one choice


def _allowed(guide: Guide, vocab: int = 264) -> set[int]:
    logits = torch.zeros(vocab)
    guide.fill_mask(logits)
    return set(torch.nonzero(logits == 0).flatten().tolist())


def test_masks_are_exact_and_eos_only_where_the_grammar_may_end():
    tok = ByteTokenizer()
    guide = compile_guide({"type": "regex", "pattern": "[ab]c+"}, tok)
    assert _allowed(guide) == {ord("a"), ord("b")}
    guide.accept(ord("b"))
    assert _allowed(guide) == {ord("c")}
    guide.accept(ord("c"))
    assert _allowed(guide) == {ord("c"), EOS, END} and not guide.is_terminated()
    guide.accept(EOS)
    assert guide.is_terminated() and _allowed(guide) == {EOS, END}

    guide = compile_guide({"type": "choice", "choices": ["ab", "abc"]}, tok)
    for c in b"ab":
        guide.accept(c)
    assert _allowed(guide) == {ord("c"), EOS, END}
    guide.accept(ord("c"))
    assert _allowed(guide) == {EOS, END} and guide.is_terminated()  # complete: nothing but a stop token


def test_fill_mask_pads_a_larger_model_vocab_and_checks_logits():
    guide = compile_guide({"type": "choice", "choices": ["x"]}, ByteTokenizer())
    gen = torch.Generator().manual_seed(105)
    logits = torch.randn(300, generator=gen)
    before = logits.clone()
    guide.fill_mask(logits)
    assert logits[ord("x")] == before[ord("x")]
    assert torch.isinf(logits[torch.arange(300) != ord("x")]).all()
    for bad in (torch.zeros(200), torch.zeros(2, 264), torch.zeros(264, dtype=torch.int64), [0.0] * 264):
        with pytest.raises(ValueError, match="logits"):
            guide.fill_mask(bad)


def test_fill_masks_batches_rows_and_leaves_unguided_ones():
    tok = ByteTokenizer()
    regex = compile_guide({"type": "regex", "pattern": "[ab]c+"}, tok)
    done = compile_guide({"type": "choice", "choices": ["x"]}, tok)
    done.accept(ord("x"))
    gen = torch.Generator().manual_seed(108)
    logits = torch.randn(3, 300, generator=gen)
    before = logits.clone()
    fill_masks([regex, None, done], logits)
    allowed = [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]
    assert allowed[0] == {ord("a"), ord("b")} and allowed[2] == {EOS, END}
    assert torch.equal(logits[1], before[1])
    assert torch.equal(logits[0][[ord("a"), ord("b")]], before[0][[ord("a"), ord("b")]])
    fill_masks([None, None], torch.zeros(2, 264))  # nothing guided: nothing to do
    with pytest.raises(ValueError, match="^guides: expected one per row"):
        fill_masks([regex], torch.zeros(2, 264))
    with pytest.raises(ValueError, match="^logits: expected a 2-D"):
        fill_masks([regex], torch.zeros(264))
    with pytest.raises(ValueError, match="^logits: expected at least"):
        fill_masks([regex], torch.zeros(1, 100))


def test_accept_rejects_disallowed_tokens_and_keeps_state():
    guide = compile_guide({"type": "regex", "pattern": "ab"}, ByteTokenizer())
    for bad in (ord("b"), EOS, 263, 300, -1):
        with pytest.raises(ValueError, match="token_id"):
            guide.accept(bad)
    for bad in (True, 97.0, "a"):
        with pytest.raises(ValueError, match="token_id"):
            guide.accept(bad)
    guide.accept(torch.tensor(ord("a")))  # the rejections left the state where it was; 0-d ints are ints
    guide.accept(ord("b"))
    guide.accept(END)
    with pytest.raises(ValueError, match="token_id: 97 is not allowed by the grammar after the end"):
        guide.accept(ord("a"))


def test_a_matcher_in_error_allows_only_stop_tokens():
    ll_tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_FakeWrapper()), eos_token=[EOS, END])
    guide = Guide(llguidance.LLMatcher(ll_tok, "start: %%% not a grammar", log_level=0), ll_tok)
    assert _allowed(guide) == {EOS, END}
    assert guide.error and guide.is_terminated()


class _FakeWrapper:
    eos_token_id, bos_token_id = EOS, 256
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<|%d|>" % i for i in range(256, 264)]
    special_token_ids = list(range(256, 264))

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


DEEP = {"type": "integer"}
for _ in range(200):
    DEEP = {"type": "array", "items": DEEP}

BAD_SPECS = [
    ("not a dict", "guided"),
    ({}, "type"),
    ({"type": "xml"}, "type"),
    ({"type": "json_object", "schema": {}}, "schema: not a field"),
    ({"type": "json_schema"}, "schema: required"),
    ({"type": "json_schema", "schema": "{}"}, "schema: expected a JSON Schema object"),
    ({"type": "json_schema", "schema": {"type": "frob"}}, "schema: Invalid type"),
    ({"type": "json_schema", "schema": {"$ref": "#/nope"}}, "schema:"),
    ({"type": "json_schema", "schema": {"type": "number", "minimum": float("nan")}}, "schema: expected plain JSON"),
    ({"type": "json_schema", "schema": {"enum": ["\ud800"]}}, "schema: not valid Unicode"),
    ({"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}, "strict": True}, "schema: Unimplemented"),
    ({"type": "json_schema", "schema": {}, "strict": "yes"}, "strict"),
    ({"type": "json_schema", "schema": {"enum": ["x" * (grammar.MAX_SPEC_CHARS + 1)]}}, "schema: .* the limit"),
    ({"type": "regex"}, "pattern: required"),
    ({"type": "regex", "pattern": 5}, "pattern: expected a string"),
    ({"type": "regex", "pattern": "a(b"}, "pattern: .*unclosed group"),
    ({"type": "regex", "pattern": "(?=a)b"}, "pattern:"),  # look-around: not a regular language
    ({"type": "regex", "pattern": "a\udc00"}, "pattern: not valid Unicode"),
    ({"type": "regex", "pattern": "a", "flags": "i"}, "flags: not a field"),
    ({"type": "choice"}, "choices"),
    ({"type": "choice", "choices": []}, "choices"),
    ({"type": "choice", "choices": "ab"}, "choices"),
    ({"type": "choice", "choices": ["a", 3]}, r"choices\[1\]: expected a string"),
    ({"type": "choice", "choices": ["a", ""]}, r"choices\[1\]: expected a non-empty"),
    ({"type": "choice", "choices": ["\ud800"]}, r"choices\[0\]: not valid Unicode"),
    ({"type": "choice", "choices": ["a"] * (grammar.MAX_CHOICES + 1)}, "choices: .* the limit"),
    ({"type": "lark", "grammar": "start: ("}, "grammar:"),
    ({"type": "json_schema", "schema": DEEP}, "schema: .*recursion limit"),
    ({"type": "regex", "pattern": "a", "\ud800": 1}, r"'\\ud800': not a field"),
    ({"type": "x" * 1000}, r"type: expected one of .*, got 'xxxx[x]*\.\.\.$"),
]


@pytest.mark.parametrize("spec,match", BAD_SPECS, ids=[m for _, m in BAD_SPECS])
def test_bad_specs_raise_naming_the_field(spec, match):
    with pytest.raises(ValueError, match=f"(?s)^{match}") as e:
        validate_guided(spec)
    assert len(str(e.value)) < 1000
    str(e.value).encode("utf-8")  # no lone surrogate reaches the message
    with pytest.raises(ValueError, match=f"(?s)^{match}"):
        compile_guide(spec, ByteTokenizer(), cache=GrammarCache())


def test_lenient_without_strict():
    validate_guided({"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}, "strict": False})
    validate_guided({"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}})


def test_response_format_mapping():
    assert response_format_to_guided({"type": "text"}) is None
    assert response_format_to_guided({"type": "json_object"}) == {"type": "json_object"}
    body = {"name": "person-1", "description": "d", "schema": SCHEMA, "strict": True}
    assert response_format_to_guided({"type": "json_schema", "json_schema": body}) == {
        "type": "json_schema", "schema": SCHEMA, "strict": True}
    assert response_format_to_guided({"type": "json_schema", "json_schema": {"name": "n", "strict": None}}) == {
        "type": "json_schema", "schema": {"type": "object"}, "strict": False}
    assert response_format_to_guided({"type": "regex", "pattern": "a+"}) == {"type": "regex", "pattern": "a+"}
    assert response_format_to_guided({"type": "choice", "choices": ["a"]}) == {"type": "choice", "choices": ["a"]}


BAD_FORMATS = [
    (["json_object"], "response_format: expected an object"),
    ({}, "response_format.type"),
    ({"type": "lark", "grammar": "start: 'a'"}, "response_format.type"),  # internal only
    ({"type": "text", "schema": {}}, "response_format.schema: not a field"),
    ({"type": "json_object", "json_schema": {}}, "response_format.json_schema: not a field"),
    ({"type": "json_schema"}, "response_format.json_schema: expected an object"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b"}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "n", "strict": 1}}, "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "n", "description": 3}}, "response_format.json_schema.description"),
    ({"type": "json_schema", "json_schema": {"name": "n", "extra": 3}}, "response_format.json_schema.extra"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "frob"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": []}}, "response_format.json_schema.schema"),
    ({"type": "regex", "pattern": "("}, "response_format.pattern"),
    ({"type": "regex"}, "response_format.pattern"),
    ({"type": "choice", "choices": [1]}, r"response_format.choices\[0\]"),
]


@pytest.mark.parametrize("body,match", BAD_FORMATS, ids=[m for _, m in BAD_FORMATS])
def test_bad_response_formats_name_the_field(body, match):
    with pytest.raises(ValueError, match=f"^{match}"):
        response_format_to_guided(body)


def test_cache_reuses_compiled_grammars_per_tokenizer():
    cache = GrammarCache(size=2)
    a, b = ByteTokenizer(), ByteTokenizer()
    spec = {"type": "choice", "choices": ["left", "right"]}
    g1 = compile_guide(spec, a, cache=cache)
    g2 = compile_guide(dict(spec), a, cache=cache)
    assert (cache.hits, cache.misses) == (1, 1)
    compile_guide(spec, b, cache=cache)  # another tokenizer object: its own entry
    assert cache.misses == 2
    g1.accept(ord("l"))  # copies are independent
    assert _allowed(g2) == {ord("l"), ord("r")}
    for i in range(3):  # LRU: size 2, the first spec is dropped
        compile_guide({"type": "regex", "pattern": f"x{i}"}, a, cache=cache)
    compile_guide(spec, a, cache=cache)
    assert cache.misses == 2 + 3 + 1
    with pytest.raises(ValueError, match="size"):
        GrammarCache(size=0)


def test_tokenizers_without_a_stop_token_or_unknown_are_refused():
    with pytest.raises(ValueError, match="^tokenizer: .*end-of-sequence"):
        compile_guide({"type": "json_object"}, IdTokenizer(512), cache=GrammarCache())
    with pytest.raises(ValueError, match="^tokenizer: expected a ByteTokenizer or HFTokenizer"):
        compile_guide({"type": "json_object"}, object(), cache=GrammarCache())
    with pytest.raises(ValueError, match="^tokenizer: .*end-of-sequence"):
        warm_tokenizer(IdTokenizer(512))
    warm_tokenizer(ByteTokenizer())


# -- a Hugging Face tokenizer: byte-level BPE trained in memory ---------------------------------
@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    gen = torch.Generator().manual_seed(106)
    words = ['{"name": "', '", "age": ', ', "color": "', "red", "green", "blue", "true", "false", "}", "]"]
    corpus = ["".join(words[int(i)] for i in torch.randint(0, len(words), (30,), generator=gen)) for _ in range(200)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus, trainer)
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>"))


def test_hf_tokenizer_outputs_validate(bpe):
    assert any(len(bpe.decode([i])) > 2 for i in range(bpe.vocab_size))  # multi-byte tokens exist
    model_vocab = bpe.vocab_size + 37  # a model's embedding is often padded past the tokenizer
    gen = torch.Generator().manual_seed(107)
    eos = bpe.eos_token_id
    for seed in range(4):
        guide = compile_guide({"type": "json_schema", "schema": SCHEMA, "strict": True}, bpe)
        out = []
        for _ in range(200):
            logits = torch.randn(model_vocab, generator=gen) * 3
            guide.fill_mask(logits)
            assert torch.isinf(logits[bpe.vocab_size:]).all()
            t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            guide.accept(t)
            out.append(t)
            if guide.is_terminated():
                break
        assert guide.is_terminated()
        ids = out[:-1] if out[-1] == eos else out
        jsonschema.validate(json.loads(bpe.decode(ids)), SCHEMA)
    mixed = [compile_guide({"type": "json_object"}, bpe), compile_guide({"type": "json_object"}, ByteTokenizer())]
    with pytest.raises(ValueError, match="^guides: expected one tokenizer vocabulary size"):
        fill_masks(mixed, torch.zeros(2, model_vocab))
