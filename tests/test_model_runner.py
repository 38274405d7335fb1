"""ModelRunner, attention registration, sampling, tokenizer and loading (CPU, reference backend)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.config import SparseConfig
from kv_cache import KVPool, KVPoolConfig
from model_executor import (
    ATTENTION_NAME,
    ByteTokenizer,
    ModelRunner,
    PrefillItem,
    Sampler,
    SamplingParams,
    build_tiny_model,
    load_model,
    load_model_dir,
)
from model_executor import fused
from router.offline import generate, make_pool
from model_executor.loading import BUILTIN_TINY

DENSE = SparseConfig(alpha=0.0)
NEW_TOKENS = 64


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[256] + torch.randint(0, 256, (n - 1,), generator=g).tolist() for n in lengths]


def _hf_greedy(model, prompt, n):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
        eos_token_id=None, pad_token_id=258,
    )
    return out[0, len(prompt):].tolist()


def _runner(loaded, *, num_pages=64, page_size=64, config=DENSE, dense_below=0):
    pool = make_pool(loaded, num_pages=num_pages, page_size=page_size)
    return ModelRunner(loaded.model, pool, config, dense_below=dense_below)


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' own greedy generate with sdpa on an identical model (separate instance:
    the runner switches its model to our attention)."""
    ref = build_tiny_model(seed=0, attn_implementation="sdpa")
    prompts = _prompts([5, 37, 70])
    return prompts, [_hf_greedy(ref.model, p, NEW_TOKENS) for p in prompts]


# -- equivalence with transformers ------------------------------------------------------
@pytest.mark.parametrize("dense_below", [0, 4096], ids=["alpha0-sparse-path", "dense-path"])
def test_greedy_matches_transformers_generate(tiny, hf_reference, dense_below):
    prompts, expected = hf_reference
    assert len(set(expected[1])) > 5  # the tiny model does not just repeat one token
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    got = generate(prompts, params, model=tiny, sparse_config=DENSE, dense_below=dense_below, page_size=16,
                   ignore_eos=True)  # transformers' run above ignores EOS too
    for res, exp in zip(got, expected):
        assert list(res.output_token_ids) == exp
        assert res.finish_reason == "length"


def test_qwen3_architecture_matches_transformers():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.1,
        max_position_embeddings=4096,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        ref_model = Qwen3ForCausalLM(cfg).eval()
    ref_model.set_attn_implementation("sdpa")
    ours = Qwen3ForCausalLM(cfg).eval()
    ours.load_state_dict(ref_model.state_dict())
    prompt = _prompts([29], seed=3)[0]
    expected = _hf_greedy(ref_model, prompt, 12)
    from model_executor.loading import LoadedModel

    loaded = LoadedModel("qwen3-tiny", ours, None, ours.config)
    got = generate([prompt], SamplingParams(temperature=0, max_new_tokens=12), model=loaded, dense_below=0,
                   sparse_config=DENSE)
    assert list(got[0].output_token_ids) == expected


def test_prefill_logits_match_transformers_and_no_mask_is_built(tiny, hf_reference):
    ref = build_tiny_model(seed=0)
    prompts = _prompts([9, 130, 64], seed=5)
    runner = _runner(tiny, config=DENSE, dense_below=0)
    for i, p in enumerate(prompts):
        runner.ensure_capacity(f"r{i}", len(p))
    logits = runner.prefill([PrefillItem(f"r{i}", p) for i, p in enumerate(prompts)])
    state = runner.last_state
    assert state.layers_called == tiny.num_layers
    assert state.masks_seen == 0  # no L x L mask reached our attention
    assert len(state.plans) == 1  # one plan shared by every layer
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = ref.model(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(logits[i], want, atol=2e-4, rtol=1e-4)
    assert tiny.model.config._attn_implementation == ATTENTION_NAME


# -- sparse prefill -----------------------------------------------------------------------
def test_sparse_alpha_runs_on_long_prompts_and_prunes(tiny):
    sparse = SparseConfig(alpha=0.5, block_size=64, sink_tokens=64, window_tokens=64)
    prompts = _prompts([700, 450], seed=7)
    logits = {}
    for name, cfg in (("sparse", sparse), ("dense", DENSE)):
        runner = _runner(tiny, config=cfg, dense_below=0)
        for i, p in enumerate(prompts):
            runner.ensure_capacity(f"r{i}", len(p))
        logits[name] = runner.prefill([PrefillItem(f"r{i}", p) for i, p in enumerate(prompts)])
    assert torch.isfinite(logits["sparse"]).all()
    assert not torch.equal(logits["sparse"], logits["dense"])  # blocks were pruned
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    out = generate(prompts, params, model=tiny, sparse_config=sparse, dense_below=0, ignore_eos=True)
    for res in out:
        assert len(res.output_token_ids) == 4
        assert all(0 <= t < tiny.config.vocab_size for t in res.output_token_ids)


def test_runner_passes_its_backend_choice_to_the_attention_stage(tiny, monkeypatch):
    """The runner hands ``auto`` to ``ops.attention_planned`` unresolved (it resolves ``auto`` to
    the CUTLASS kernel on a GPU; resolving it first made ``auto`` mean Triton there), and a
    forced choice as given."""
    from kernels import ops

    seen = []
    real = ops.attention_planned

    def spy(*args, backend="auto", **kw):
        seen.append(backend)
        return real(*args, backend="reference", **kw)

    monkeypatch.setattr(ops, "attention_planned", spy)
    sparse = SparseConfig(alpha=0.5, block_size=64, sink_tokens=64, window_tokens=64)
    for backend in ("auto", "reference"):
        seen.clear()
        pool = make_pool(tiny, num_pages=64, page_size=64)
        runner = ModelRunner(tiny.model, pool, sparse, dense_below=0, backend=backend)
        runner.ensure_capacity("r", 300)
        runner.prefill([PrefillItem("r", _prompts([300])[0])])
        assert seen and set(seen) == {backend}, (backend, seen)


# -- fused elementwise ops ------------------------------------------------------------------
def test_fused_ops_match_the_eager_model(tiny, monkeypatch):
    """fused_ops=True runs every RMSNorm and SiLU MLP of the model through kernels/elementwise
    (Triton, under the interpreter here) with the same logits as the eager modules; False puts
    the eager forwards back; the default on CPU leaves them eager."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from model_executor import fused

    from kernels import elementwise

    from kernels import rope_kv

    monkeypatch.setattr(fused, "SILU_MUL_MIN_TOKENS", 1)  # these few tokens run the fused MLP too
    layers = tiny.model.config.num_hidden_layers
    prompts = _prompts([90, 33], seed=5)
    logits = {}
    calls = {"rotary": [], "rope_kv": []}
    real_rotary, real_rope_kv = elementwise.rotary, rope_kv.rope_kv_write
    monkeypatch.setattr(elementwise, "rotary", lambda *a, **k: calls["rotary"].append(1) or real_rotary(*a, **k))
    monkeypatch.setattr(rope_kv, "rope_kv_write", lambda *a, **k: calls["rope_kv"].append(1) or real_rope_kv(*a, **k))
    # eager; fused with RoPE and the K/V write in one kernel; fused with them apart (the pool's write)
    for mode in (False, True, "rope-apart"):
        if mode == "rope-apart":
            monkeypatch.setattr(fused, "rope_kv_fusable", lambda batch, dtype: False)
        pool = make_pool(tiny, num_pages=16, page_size=64)
        runner = ModelRunner(tiny.model, pool, DENSE, dense_below=0, fused_ops=bool(mode))
        for c in calls.values():
            c.clear()  # the runner's self-check ran each kernel once
        assert runner.fused_counts == ({"rms_norm": 2 * layers + 1, "silu_mul": layers, "rotary": layers} if mode
                                       else {"rms_norm": 0, "silu_mul": 0, "rotary": 0})
        for i, p in enumerate(prompts):
            runner.ensure_capacity(f"r{i}", len(p))
        logits[mode] = runner.prefill([PrefillItem(f"r{i}", p) for i, p in enumerate(prompts)])
        runner.ensure_capacity("r0", len(prompts[0]) + 1)
        runner.ensure_capacity("r1", len(prompts[1]) + 1)
        logits[(mode, "decode")] = runner.decode(["r0", "r1"], [3, 4])
        # the fused path ran: one RoPE + K/V write per layer, prefill and decode; or q and k apart
        want = {False: (0, 0), True: (0, 2 * layers), "rope-apart": (2 * 2 * layers, 0)}[mode]
        assert (len(calls["rotary"]), len(calls["rope_kv"])) == want, mode
    for mode in (True, "rope-apart"):
        torch.testing.assert_close(logits[mode], logits[False], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[(mode, "decode")], logits[(False, "decode")], atol=1e-4, rtol=1e-4)
    # the default on CPU: eager (and it takes back what an earlier runner installed)
    fused.install(tiny.model)
    runner = ModelRunner(tiny.model, make_pool(tiny, num_pages=4, page_size=64), DENSE)
    assert runner.fused_counts == {"rms_norm": 0, "silu_mul": 0, "rotary": 0} == fused.installed(tiny.model)
    assert all("forward" not in m.__dict__ for m in tiny.model.modules())


def test_fused_mlp_leaves_small_batches_to_eager(monkeypatch):
    """Below SILU_MUL_MIN_TOKENS tokens the fused MLP forward computes eager ``act_fn(gate) * up``
    (the fused call costs more there, see fused.py); from it on, the kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from kernels import elementwise

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=24, hidden_act="silu", num_attention_heads=2,
                                num_key_value_heads=1))
    calls = []
    real = elementwise.silu_mul
    monkeypatch.setattr(elementwise, "silu_mul", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setattr(fused, "SILU_MUL_MIN_TOKENS", 8)
    with torch.no_grad():
        x = torch.randn(1, 10, 16)
        want = mlp(x)
        assert fused.install(mlp, backend="triton")["silu_mul"] == 1
        for tokens, fused_call in ((7, False), (8, True), (10, True)):
            calls.clear()
            got = mlp(x[:, :tokens])
            assert bool(calls) == fused_call, tokens
            torch.testing.assert_close(got, want[:, :tokens], atol=1e-6, rtol=1e-5)


def test_fused_attention_falls_back_outside_the_paged_runner():
    """With a transformers cache (sdpa, generate) the fused attention forward hands over to the
    class's own; fused norms/MLPs on the reference backend are eager's math: same logits, bit for bit."""
    from model_executor import fused

    model = build_tiny_model(seed=0, attn_implementation="sdpa").model
    ids = torch.tensor([_prompts([21], seed=2)[0]])
    with torch.no_grad():
        want = model(ids, use_cache=True).logits
        assert fused.install(model, backend="reference")["rotary"] == model.config.num_hidden_layers
        got = model(ids, use_cache=True).logits
    assert torch.equal(got, want)
    layers = model.config.num_hidden_layers
    assert fused.uninstall(model) == (2 * layers + 1) + layers + layers  # norms, MLPs, attentions
    assert fused.installed(model) == {"rms_norm": 0, "silu_mul": 0, "rotary": 0}


def test_fused_install_leaves_unknown_modules_alone():
    from model_executor import fused

    class GemmaRMSNorm(torch.nn.Module):  # (1 + weight) norm: not the same math
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

    class LlamaMLP(torch.nn.Module):  # the right name, a GELU activation: left eager
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(8, 8) for _ in range(3))
            self.act_fn = torch.nn.GELU()

    model = torch.nn.Sequential(GemmaRMSNorm(), LlamaMLP())
    assert fused.install(model) == {"rms_norm": 0, "silu_mul": 0, "rotary": 0} and fused.uninstall(model) == 0
    with pytest.raises(ValueError, match="backend"):
        fused.install(model, backend="cuda")


def test_fused_self_check(tiny, monkeypatch):
    """The check the runner makes before it installs the kernels: passes at the tiny model's
    sizes (interpreter), names the kernel that disagrees or fails, and fused_ops=True refuses then."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels import elementwise
    from model_executor import fused

    fused._self_check.cache_clear()
    assert fused.self_check(tiny.model, torch.device("cpu")) is None
    fused._self_check.cache_clear()
    monkeypatch.setattr(elementwise, "silu_mul", lambda g, u, backend: g * u)  # forgot the silu
    why = fused.self_check(tiny.model, torch.device("cpu"))
    assert why is not None and why.startswith("silu_mul: max |fused - reference|")
    with pytest.raises(ValueError, match="fused_ops: the fused kernels fail their check"):
        ModelRunner(tiny.model, make_pool(tiny, num_pages=4, page_size=64), DENSE, fused_ops=True)
    fused._self_check.cache_clear()

    def broken(*a, **k):
        raise RuntimeError("PTX compile failed")

    monkeypatch.setattr(elementwise, "rotary", broken)
    assert "RuntimeError: PTX compile failed" in fused.self_check(tiny.model, torch.device("cpu"))
    fused._self_check.cache_clear()


def test_fused_ops_refused_without_triton(tiny, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = make_pool(tiny, num_pages=4, page_size=64)
    with pytest.raises(ValueError, match="fused_ops"):
        ModelRunner(tiny.model, pool, DENSE, fused_ops=True)
    with pytest.raises(ValueError, match="fused_ops"):
        ModelRunner(tiny.model, pool, DENSE, fused_ops="yes")


# -- chunked prefill ------------------------------------------------------------------------
@pytest.mark.parametrize("config", [DENSE, SparseConfig(alpha=0.1, block_size=64, sink_tokens=64,
                                                        window_tokens=128)], ids=["dense", "sparse"])
def test_chunked_prefill_equals_one_piece(tiny, config):
    prompts = _prompts([200, 77], seed=11)
    one = _runner(tiny, config=config)
    for i, p in enumerate(prompts):
        one.ensure_capacity(f"r{i}", len(p))
    want = one.prefill([PrefillItem(f"r{i}", p) for i, p in enumerate(prompts)])

    chunked = _runner(tiny, config=config)
    for i, p in enumerate(prompts):
        chunked.ensure_capacity(f"r{i}", len(p))
    chunk, done, last = 64, [0, 0], {}
    while any(d < len(p) for d, p in zip(done, prompts)):
        items = [PrefillItem(f"r{i}", p[done[i]: done[i] + chunk], done[i])
                 for i, p in enumerate(prompts) if done[i] < len(p)]
        out = chunked.prefill(items)
        for row, it in enumerate(items):
            i = int(it.request_id[1:])
            done[i] += len(it.token_ids)
            last[i] = out[row]
    got = torch.stack([last[0], last[1]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for i, p in enumerate(prompts):
        assert chunked.pool.seq_len(f"r{i}") == len(p)
        assert len(chunked.pool.pages(f"r{i}")) == -(-len(p) // chunked.page_size)


def test_runner_rejects_bad_input(tiny):
    runner = _runner(tiny)
    with pytest.raises(ValueError, match="request_id"):
        runner.prefill([PrefillItem("nope", [1, 2, 3])])
    runner.ensure_capacity("a", 10)
    with pytest.raises(ValueError, match="token_ids"):
        runner.prefill([PrefillItem("a", [])])
    with pytest.raises(ValueError, match="token_ids"):
        runner.prefill([PrefillItem("a", [1, 100000])])
    with pytest.raises(ValueError, match="cached_len"):
        runner.prefill([PrefillItem("a", [1, 2], cached_len=3)])
    with pytest.raises(ValueError, match="room for"):
        runner.prefill([PrefillItem("a", list(range(100)))])
    with pytest.raises(ValueError, match="last_token_ids"):
        runner.decode(["a"], [])
    bad_pool = KVPool(KVPoolConfig(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, num_pages=4))
    with pytest.raises(ValueError, match="pool"):
        ModelRunner(tiny.model, bad_pool)
    with pytest.raises(ValueError, match="dense_below"):
        ModelRunner(tiny.model, runner.pool, dense_below=-1)


# -- sampling ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids="ab"), "stop_token_ids"),
        (dict(seed=-3), "seed"),
        (dict(seed=True), "seed"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_frozen_and_normalised():
    p = SamplingParams(stop_token_ids=[3, 4])
    assert p.stop_token_ids == (3, 4)
    with pytest.raises(Exception):
        p.temperature = 2.0  # type: ignore[misc]


def _logits(b=4, v=300, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_equal_argmax():
    logits = _logits()
    sampler = Sampler()
    want = logits.argmax(-1)
    greedy = [SamplingParams(temperature=0.0)] * 4
    assert torch.equal(sampler(logits, greedy, [0] * 4), want)
    topk1 = [SamplingParams(temperature=1.3, top_k=1, seed=i) for i in range(4)]
    assert torch.equal(sampler(logits, topk1, [0] * 4), want)
    tiny_p = [SamplingParams(temperature=0.7, top_p=1e-6, seed=i) for i in range(4)]
    assert torch.equal(sampler(logits, tiny_p, [5] * 4), want)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = _logits(b=3)
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=s) for s in (1, 2, 3)]
    a = Sampler()(logits, params, [4, 4, 4])
    b = Sampler()(logits, params, [4, 4, 4])
    assert torch.equal(a, b)
    alone = Sampler()(logits[1:2], params[1:2], [4])
    assert alone.item() == a[1].item()
    # different steps draw differently (over many steps, not all equal)
    draws = [Sampler()(logits[:1], params[:1], [s]).item() for s in range(20)]
    assert len(set(draws)) > 1


def test_sampling_respects_top_k_and_matches_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0, top_k=3, seed=i) for i in range(4000)]
    tokens = Sampler()(logits, params, [0] * 4000)
    assert set(tokens.tolist()) <= {0, 1, 2}
    probs = torch.softmax(logits[0, :3], -1)
    freq = torch.bincount(tokens, minlength=3)[:3].float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_seeded_generation_is_reproducible(tiny):
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, max_new_tokens=12, seed=1234)
    prompts = _prompts([20, 33], seed=2)
    a = generate(prompts, params, model=tiny)
    b = generate(prompts, params, model=tiny)
    c = generate(prompts[1:], params, model=tiny)  # alone in its batch
    assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]
    assert a[1].output_token_ids == c[0].output_token_ids


# -- tokenizer and built-in model -------------------------------------------------------------
def test_byte_tokenizer_roundtrip_and_chat_template():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == [tok.bos_token_id, tok.special_id("<|user|>"), 104, 105, tok.end_of_turn_id,
                    tok.special_id("<|assistant|>")]
    assert "<|user|>" in tok.decode(chat, skip_special_tokens=False)
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_builtin_model_is_deterministic_and_text_generation_works():
    a = load_model(BUILTIN_TINY)
    b = load_model(None)
    for (na, pa), (nb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    assert (a.num_layers, a.num_kv_heads, a.head_dim) == (4, 2, 64)
    out = generate(["hello"], SamplingParams(temperature=0, max_new_tokens=3), model=a, ignore_eos=True)
    assert len(out[0].output_token_ids) == 3
    assert isinstance(a.tokenizer.decode(out[0].output_token_ids), str)


# -- loading a local directory --------------------------------------------------------------
def _save_dir(path, with_tokenizer=True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    loaded = build_tiny_model(seed=3, num_layers=2)
    loaded.model.save_pretrained(path)
    if with_tokenizer:
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(97 + i): 3 + i for i in range(26)}}
        core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        PreTrainedTokenizerFast(
            tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        ).save_pretrained(path)
    return loaded


def test_load_model_dir_roundtrip(tmp_path):
    src = _save_dir(tmp_path)
    loaded = load_model_dir(tmp_path)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, src.model(ids).logits)
    assert loaded.tokenizer.encode("abc", add_bos=False) == [3, 4, 5]


def test_load_model_dir_errors_name_the_file(tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(FileNotFoundError, match="model_dir"):
        load_model_dir(tmp_path / "absent")

    d = tmp_path / "no_config"
    _save_dir(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_dir(d)

    d = tmp_path / "bad_json"
    _save_dir(d)
    (d / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ValueError, match="config.json.*line"):
        load_model_dir(d)

    d = tmp_path / "bad_arch"
    _save_dir(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type"):
        load_model_dir(d)

    d = tmp_path / "no_weights"
    _save_dir(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model_dir(d)

    d = tmp_path / "broken_weights"
    _save_dir(d)
    (d / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model_dir(d)

    d = tmp_path / "shape"
    _save_dir(d)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = torch.zeros(64, 256)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.safetensors: tensor model.layers.0.self_attn.k_proj.weight"):
        load_model_dir(d)

    d = tmp_path / "missing_tensor"
    _save_dir(d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model_dir(d)

    d = tmp_path / "no_tokenizer"
    _save_dir(d, with_tokenizer=False)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_model_dir(d)
    assert load_model_dir(d, load_tokenizer=False).tokenizer is None


# -- GPU (Triton backend) ------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_bf16_prefill_close_to_sdpa_and_generation_runs():
    ref = build_tiny_model(seed=0, dtype=torch.bfloat16, device="cuda")
    ours = build_tiny_model(seed=0, dtype=torch.bfloat16, device="cuda")
    prompts = _prompts([300, 1100, 65], seed=8)
    runner = _runner(ours, num_pages=64, config=DENSE, dense_below=0)
    # on CUDA the fused norm/MLP/RoPE kernels pass their self-check and run (ref stays eager)
    assert all(n > 0 for n in runner.fused_counts.values()), runner.fused_counts
    assert not any(fused.installed(ref.model).values())
    for i, p in enumerate(prompts):
        runner.ensure_capacity(f"r{i}", len(p))
    logits = runner.prefill([PrefillItem(f"r{i}", p) for i, p in enumerate(prompts)])
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = ref.model(torch.tensor([p], device="cuda")).logits[0, -1].float()
            assert (logits[i] - want).abs().max() < 0.1 * want.abs().max()
    sparse = SparseConfig(alpha=0.2, block_size=128, sink_tokens=128, window_tokens=256)
    out = generate(prompts, SamplingParams(temperature=0, max_new_tokens=16), model=ours,
                   sparse_config=sparse, dense_below=512, ignore_eos=True)
    assert all(len(r.output_token_ids) == 16 for r in out)


# -- FP8 KV pool ---------------------------------------------------------------------------
def _fp8_runner(loaded, *, config=DENSE, dense_below=0):
    pool = make_pool(loaded, num_pages=64, page_size=16, dtype=torch.float8_e4m3fn)
    runner = ModelRunner(loaded.model, pool, config, dense_below=dense_below)
    runner.calibrate_kv_scales()
    return runner


def test_fp8_pool_calibration_is_deterministic_pow2_and_frees_its_pages(tiny):
    a, b = _fp8_runner(tiny), _fp8_runner(tiny)
    assert torch.equal(a.pool.k_scale, b.pool.k_scale) and torch.equal(a.pool.v_scale, b.pool.v_scale)
    for scales in (a.pool.k_scale, a.pool.v_scale):
        assert (scales > 0).all() and (scales != 1.0).any()
        assert torch.equal(torch.exp2(torch.round(torch.log2(scales))), scales)  # powers of two
    assert a.pool.free_pages == a.pool.num_pages
    assert not a.pool.has(ModelRunner.CALIBRATION_ID)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_fp8_pool_prefill_and_decode_close_to_full_precision(tiny, sparse):
    config = SparseConfig(alpha=0.2, block_size=64, sink_tokens=64, window_tokens=64) if sparse else DENSE
    prompt = _prompts([300])[0]
    logits = []
    for runner in (_runner(tiny, config=config, page_size=16), _fp8_runner(tiny, config=config)):
        runner.ensure_capacity("r", len(prompt) + 2)
        first = runner.prefill([PrefillItem("r", prompt)])
        nxt = int(first.argmax())
        step = runner.decode(["r"], [nxt])
        logits.append((first, step))
    for full, quant in zip(logits[0], logits[1]):
        # e4m3 keeps 3 mantissa bits of every q/K/V element; the tiny model's random weights
        # give sharp attention, so its logits move by ~20% (a wrong scale or layout gives ~100%),
        # and the top token survives
        assert ((quant - full).norm() / full.norm()).item() < 0.3
        assert int(quant.argmax()) == int(full.argmax())


def test_fp8_calibration_errors(tiny):
    runner = _runner(tiny)
    with pytest.raises(ValueError, match="pool: only FP8 pools have scales to calibrate"):
        runner.calibrate_kv_scales()
    fp8_runner = _fp8_runner(tiny)
    with pytest.raises(ValueError, match="margin: expected a number >= 1"):
        fp8_runner.calibrate_kv_scales(margin=0.5)
    with pytest.raises(ValueError, match="token_ids: expected at least one calibration token"):
        fp8_runner.calibrate_kv_scales([])
    with pytest.raises(ValueError, match="token_ids: token id"):
        fp8_runner.calibrate_kv_scales([10**6])
