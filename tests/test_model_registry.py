"""The model registry (model_executor/models): each family's spec is what the loaders, the fused
and FP8 forwards, tensor parallelism, tool calling and GGUF read; a family added in one file plus
one registry line (tests/toy_architecture.py) loads, prefills through ModelRunner, splits for TP
and lists its FP8 targets, with no other file touched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import toy_architecture
from kernels.config import SparseConfig
from model_executor import ModelRunner, PrefillItem, fp8_linear, fused, models, parallel, tools
from model_executor.loading import load_model_dir, make_pool
from model_executor.models import ArchitectureSpec, LayerClasses, Split

DENSE = SparseConfig(alpha=0.0)


@pytest.fixture
def toy():
    models.register(toy_architecture.SPEC)  # the one registry line
    try:
        yield toy_architecture
    finally:
        models.unregister(toy_architecture.MODEL_TYPE)


def _toy_model(seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return toy_architecture.ToyForCausalLM(toy_architecture.toy_config()).eval()


# -- the product families -------------------------------------------------------------------------
def test_product_families_and_their_declarations():
    assert models.supported_model_types() == ("llama", "qwen2", "qwen3")
    assert models.tool_call_formats() == {"llama": "llama3_json", "qwen2": "hermes", "qwen3": "hermes"}
    assert models.for_gguf("qwen2") is models.get("qwen2")
    assert models.layer_classes("attention", lambda s: "rotary" in s.fused_ops) == {"LlamaAttention"}
    assert models.layer_classes("norm") == {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
    from transformers import LlamaConfig, Qwen3ForCausalLM

    assert models.get("llama").config_cls() is LlamaConfig and models.get("qwen3").model_cls() is Qwen3ForCausalLM


def test_unknown_model_type_names_it_and_lists_the_supported():
    for bad in ("mistral", None, 7):
        with pytest.raises(ValueError, match=r"^model_type: expected one of \('llama', 'qwen2', 'qwen3'\), got "):
            models.get(bad)
    with pytest.raises(ValueError, match=r"^general.architecture: expected one of \('llama', 'qwen2', 'qwen3'\)"):
        models.for_gguf("gpt2")
    with pytest.raises(ValueError, match="^model_type: expected one of"):
        models.unregister("mistral")


def test_register_refuses_a_taken_model_type_and_a_non_spec():
    with pytest.raises(ValueError, match="^model_type: 'llama' is registered already"):
        models.register(models.get("llama"))
    with pytest.raises(ValueError, match="^spec: expected an ArchitectureSpec"):
        models.register({"model_type": "x"})


@pytest.mark.parametrize("field, value, message", [
    ("model_type", "", "^model_type: expected a non-empty str"),
    ("config_class", "transformers.LlamaConfig", "^config_class: expected 'module:Name'"),
    ("fused_ops", frozenset({"gelu"}), "^fused_ops: expected a frozenset of"),
    ("fused_ops", {"rms_norm"}, "^fused_ops: expected a frozenset of"),
    ("tool_call_format", "pythonic", "^tool_call_format: expected one of"),
    ("tp_split", (("fc1", Split("column", "q_heads")),), "^tp_split: expected each of the projections"),
    ("tp_split", (("q_proj", Split("column", "q_heads")),) * 2, "^tp_split: expected each of the projections"),
    ("fp8_targets", ("lm_head",), "^fp8_targets: expected projections among"),
])
def test_spec_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(toy_architecture.SPEC, **{field: value})


def test_split_validation_and_unimportable_classes():
    with pytest.raises(ValueError, match="^parallel: expected 'column' or 'row'"):
        Split("diagonal", "q_heads")
    with pytest.raises(ValueError, match="^by: expected one of"):
        Split("row", "vocab")
    spec = dataclasses.replace(toy_architecture.SPEC, model_class="transformers:NoSuchForCausalLM")
    with pytest.raises(ValueError, match="^model_class: cannot import 'transformers:NoSuchForCausalLM'"):
        spec.model_cls()


# -- a family added in one file plus one registry line --------------------------------------------
def test_toy_family_loads_and_prefills_through_the_runner(toy, tmp_path):
    """Saved with its own class, read back by load_model_dir (its config and model class come from
    the spec: transformers' Auto classes do not know ``toy_llama``), prefilled through ModelRunner;
    the last-token logits are transformers' eager forward of the saved model."""
    ref = _toy_model(seed=4)
    ref.save_pretrained(tmp_path)
    loaded = load_model_dir(tmp_path, load_tokenizer=False)
    assert type(loaded.model) is toy.ToyForCausalLM and loaded.config.model_type == "toy_llama"
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (19, 70)]
    runner = ModelRunner(loaded.model, make_pool(loaded, num_pages=8, page_size=16), DENSE, dense_below=0)
    for i, p in enumerate(prompts):
        runner.ensure_capacity(f"r{i}", len(p))
    logits = runner.prefill([PrefillItem(f"r{i}", p) for i, p in enumerate(prompts)])
    assert runner.last_state.layers_called == 2
    with torch.no_grad():
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i], ref(torch.tensor([p])).logits[0, -1], atol=2e-4, rtol=1e-4)


def test_toy_family_is_refused_until_registered(tmp_path):
    _toy_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^config.json: model_type: expected one of \('llama', 'qwen2', 'qwen3'\), "
                                         r"got 'toy_llama'"):
        load_model_dir(tmp_path, load_tokenizer=False)


def test_toy_family_fused_ops_are_its_declared_ones(toy):
    model = _toy_model()
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 300, (1, 23), generator=g)
    with torch.no_grad():
        want = model(ids).logits
        assert fused.install(model, backend="reference") == {"rms_norm": 2 * 2 + 1, "silu_mul": 0, "rotary": 0}
        torch.testing.assert_close(model(ids).logits, want, atol=1e-5, rtol=1e-5)
    assert fused.uninstall(model) == 5


def test_toy_family_fp8_targets_are_its_attention_projections(toy):
    model = _toy_model()
    attention = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert fp8_linear.projection_names(model) == attention
    assert fp8_linear.quantize_model(model, "channel") == 8
    assert sorted(fp8_linear.fp8_layers(model)) == sorted(attention)
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)  # the MLP keeps its dtype
    counts = fp8_linear.install_forwards(model, kernels=False, fp8_pool=True)
    assert counts == {"fp8_linear": 8, "norm_quant": 2, "q_amax": 2, "silu_quant": 0}  # input norms feed q/k/v


def test_toy_family_tensor_parallel_split(toy):
    """Rank 1 of 2: q/o by its 2 query heads, k/v by its KV head, gate/up/down by half the MLP
    (the dense split the toy declares); the row-parallel o/down get the all-reduce hook."""
    model = _toy_model()
    cfg = model.config
    layout = parallel.layout_of(cfg, 2)
    slices = {p: parallel.shard_slice(f"model.layers.0.{m}.{p}.weight", cfg, layout, 1)
              for m, ps in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
              for p in ps}
    assert slices == {"q_proj": (0, 64, 64), "k_proj": (0, 32, 32), "v_proj": (0, 32, 32), "o_proj": (1, 64, 64),
                      "gate_proj": (0, 128, 128), "up_proj": (0, 128, 128), "down_proj": (1, 128, 128)}
    assert parallel.shard_slice("model.layers.0.input_layernorm.weight", cfg, layout, 1) is None
    shard = parallel.shard_model(model, parallel.TensorParallel(1, 2, group=object()))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert (attn.q_proj.weight.shape, attn.k_proj.weight.shape, attn.o_proj.weight.shape) == \
        ((64, 128), (32, 128), (128, 64))
    assert (mlp.up_proj.weight.shape, mlp.down_proj.weight.shape) == ((128, 128), (128, 128))
    assert sorted(shard.hooks) == [f"model.layers.{i}.{m}" for i in range(2) for m in ("mlp.down_proj", "self_attn.o_proj")]


def test_toy_family_tool_calls_and_no_gguf(toy):
    text = 'sure\n<tool_call>\n{"name": "lookup", "arguments": {"q": 1}}\n</tool_call>'
    content, calls = tools.extract_tool_calls(text, "toy_llama")
    assert content == "sure" and [c["function"]["name"] for c in calls] == ["lookup"]
    with pytest.raises(ValueError, match=r"^general.architecture: expected one of \('llama', 'qwen2', 'qwen3'\)"):
        models.for_gguf("toy_llama")


def test_a_layer_of_no_family_is_refused_by_tp_and_fp8():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = MistralForCausalLM(cfg)
    with pytest.raises(ValueError, match="^model: tensor parallelism needs decoder layers of a registered family"):
        parallel.shard_model(model, parallel.TensorParallel(0, 2, group=object()))
    with pytest.raises(ValueError, match="^model_type: expected one of"):
        parallel.shard_slice("model.layers.0.self_attn.q_proj.weight", cfg, parallel.layout_of(cfg, 2), 0)
    assert models.for_layer(model.model.layers[0]) is None
    assert models.for_layer(LayerClasses("a", "b", "c")) is None  # no self_attn / mlp at all
