"""Service pieces without a cluster: request validation, detokenization, the cost model, the
routers' ranking (fake replicas), the request state machine, the config."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("ray.serve")

from model_executor.sampling import SamplingParams  # noqa: E402
from model_executor.tokenizer import ByteTokenizer  # noqa: E402
from serving.config import ServiceConfig  # noqa: E402
from serving.messages import StagePages  # noqa: E402
from router.detokenize import TextStream  # noqa: E402
from serving.errors import RequestError  # noqa: E402
from router.parsing import RequestParser  # noqa: E402
from router.scheduling import (  # noqa: E402
    DecodeRequestRouter,
    PrefillCostModel,
    PrefillRequestRouter,
    routing_hint,
)
from router.state import IllegalTransition, RequestLifecycle, RequestPhase  # noqa: E402


def parser(max_model_len=64) -> RequestParser:
    return RequestParser(ByteTokenizer(), model_id="m", max_model_len=max_model_len, default_max_tokens=16)


# ----------------------------------------------------------------------------- protocol
def test_parse_completion_defaults_and_fields():
    req = parser().parse({"model": "m", "prompt": "hi", "temperature": 0, "stop": "x", "seed": 5,
                          "top_k": -1, "n": 1, "user": "u", "presence_penalty": 0}, "completion")
    assert req.prompt_token_ids == (256, ord("h"), ord("i"))
    assert req.max_tokens == 16 and req.temperature == 0.0 and req.stop == ("x",) and req.seed == 5 and req.top_k == 0
    assert req.stop_token_ids == ByteTokenizer().stop_token_ids
    sp = req.sampling_params()
    assert sp == SamplingParams(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=16,
                                stop_token_ids=tuple(ByteTokenizer().stop_token_ids), seed=5)
    # batch of one, token ids, default max_tokens clipped to the room left
    req = parser(max_model_len=10).parse({"model": "m", "prompt": [[1, 2, 3]]}, "completion")
    assert req.prompt_token_ids == (1, 2, 3) and req.max_tokens == 7


def test_parse_chat():
    req = parser().parse({"model": "m", "messages": [{"role": "system", "content": "s"},
                                                     {"role": "user", "content": [{"type": "text", "text": "q"}]}],
                          "max_completion_tokens": 3}, "chat")
    assert req.kind == "chat" and req.max_tokens == 3 and req.prompt_token_ids[-1] == ByteTokenizer().special_id("<|assistant|>")


@pytest.mark.parametrize(
    "body,param,status",
    [
        ({"prompt": "x"}, "model", 400),
        ({"model": "other", "prompt": "x"}, "model", 404),
        ({"model": "m"}, "prompt", 400),
        ({"model": "m", "prompt": ["a", 5]}, "prompt", 400),
        ({"model": "m", "prompt": [True]}, "prompt", 400),
        ({"model": "m", "prompt": "x" * 80}, "prompt", 400),
        ({"model": "m", "prompt": "x", "max_tokens": 70}, "max_tokens", 400),
        ({"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens", 400),
        ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature", 400),
        ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature", 400),
        ({"model": "m", "prompt": "x", "top_p": 1.1}, "top_p", 400),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop", 400),
        ({"model": "m", "prompt": "x", "stop": 3}, "stop", 400),
        ({"model": "m", "prompt": "x", "seed": True}, "seed", 400),
        ({"model": "m", "prompt": "x", "n": 0}, "n", 400),
        ({"model": "m", "prompt": "x", "echo": 1}, "echo", 400),
        ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs", 400),
        ({"model": "m", "prompt": "x", "best_of": 0}, "best_of", 400),
        ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty", 400),
        ({"model": "m", "prompt": "x", "request_id": ""}, "request_id", 400),
        ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
         "stream_options.include_usage", 400),
    ],
)
def test_parse_rejects(body, param, status):
    with pytest.raises(RequestError) as info:
        parser().parse(body, "completion")
    assert info.value.param == param and info.value.status == status
    err = info.value.to_dict()["error"]
    assert err["param"] == param and err["message"].startswith(param) or status == 404


def test_parse_rejects_chat_and_body():
    with pytest.raises(RequestError) as info:
        parser().parse([], "completion")
    assert info.value.status == 400
    with pytest.raises(RequestError) as info:
        parser().parse({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "chat")
    assert info.value.param == "messages[0].tool_calls"
    with pytest.raises(RequestError) as info:
        parser().parse({"model": "m", "messages": [{"role": "user", "content": 3}]}, "chat")
    assert info.value.param == "messages[0].content"
    with pytest.raises(RequestError):
        parser().parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                        "max_completion_tokens": 2}, "chat")
    with pytest.raises(ValueError, match="kind"):
        parser().parse({}, "embedding")


def test_request_error_pickles_for_ray():
    import pickle  # Ray ships exceptions between processes this way

    err = pickle.loads(pickle.dumps(RequestError("busy", status=429, code="overloaded", retry_after_s=2)))
    assert err.status == 429 and err.retry_after_s == 2 and err.to_dict()["error"]["type"] == "rate_limit_error"


# ----------------------------------------------------------------------------- detokenizer
def test_text_stream_holds_partial_utf8_and_stop_strings():
    tok = ByteTokenizer()
    ts = TextStream(tok)
    euro = list("€".encode())
    assert ts.push([ord("a")]) == "a"
    assert ts.push(euro[:1]) == "" and ts.push(euro[1:2]) == ""
    assert ts.push(euro[2:]) == "€"
    assert ts.push([tok.eos_token_id]) == "" and ts.finish() == ""

    ts = TextStream(tok, stop=["END"])
    out = "".join(ts.push([b]) for b in b"abcEN")
    assert out == "abc"  # "EN" may start "END": held back
    assert ts.push([ord("D")]) == "" and ts.stopped and ts.text == "abc"
    ts = TextStream(tok, stop=["END"])
    out = "".join(ts.push([b]) for b in b"abENx") + ts.finish()
    assert out == "abENx" and not ts.stopped


# ----------------------------------------------------------------------------- scheduling
def test_cost_model():
    m = PrefillCostModel(token_weight=0.0, dense_below=100, expected_density=0.5)
    assert m.cost(10) == 10 * 11 / 2  # dense: every causal pair
    assert m.cost(200) == pytest.approx(200 * 201 / 2 * 0.5)
    assert m.cost(10, cached_prefix=10) == 0 and m.cost(10, 4) == 6 * 15 / 2
    assert PrefillCostModel().cost(4000) > 100 * PrefillCostModel().cost(40)
    with pytest.raises(ValueError):
        m.cost(5, cached_prefix=6)
    with pytest.raises(ValueError):
        PrefillCostModel(expected_density=2.0)


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 8

    @property
    def replica_id(self):
        return self.name


def pending(cost=0.0, pages=0, key="r"):
    return SimpleNamespace(args=[], kwargs={"routing": routing_hint(cost=cost, pages=pages)},
                           metadata=SimpleNamespace(internal_request_id=key))


def _router(cls):
    router = cls.__new__(cls)  # the ranking only needs the state initialize_state builds
    router.initialize_state()
    return router


def test_prefill_router_ranks_by_outstanding_causal_work():
    router = _router(PrefillRequestRouter)
    a = FakeReplica("a", {"outstanding_cost": 1e6, "free_pages": 100})
    b = FakeReplica("b", {"outstanding_cost": 10.0, "free_pages": 100})
    c = FakeReplica("c", {"outstanding_cost": 0.0, "free_pages": 1})  # no room for 5 pages
    ranked = asyncio.run(router.choose_replicas([a, b, c], pending(cost=100.0, pages=5)))
    assert [[r.name for r in tier] for tier in ranked] == [["b"], ["a"], ["c"]]
    # requests routed between two stats refreshes count too
    router.on_request_routed(pending(cost=5e6, key="big"), "b", None)
    ranked = asyncio.run(router.choose_replicas([a, b], pending(cost=100.0, pages=5)))
    assert ranked[0][0].name == "a"
    router.on_request_completed("b", "big")
    ranked = asyncio.run(router.choose_replicas([a, b], pending(cost=100.0, pages=5)))
    assert ranked[0][0].name == "b"
    # near-equal replicas share the first tier (Serve then picks by queue length)
    x, y = FakeReplica("x", {"outstanding_cost": 1000.0}), FakeReplica("y", {"outstanding_cost": 1050.0})
    ranked = asyncio.run(router.choose_replicas([x, y], pending(cost=10.0)))
    assert sorted(r.name for r in ranked[0]) == ["x", "y"]
    # no stats yet: everyone is a candidate
    assert len(asyncio.run(router.choose_replicas([FakeReplica("p"), FakeReplica("q")], None))[0]) == 2


def test_prefill_router_pins_calls_for_one_replica():
    import time

    router = _router(PrefillRequestRouter)
    a = FakeReplica("a", {"outstanding_cost": 0.0})
    b = FakeReplica("b", {"outstanding_cost": 1e9, "free_pages": 0})  # the worst choice, but it holds the pages

    def pinned(replica, age_s=0.0):
        return SimpleNamespace(args=[], kwargs={"routing": routing_hint(replica=replica)}, created_at=time.time() - age_s,
                               metadata=SimpleNamespace(internal_request_id="send"))

    assert routing_hint(replica="b") == {"cost": 0.0, "pages": 0, "replica": "b"}
    assert [[r.name for r in t] for t in asyncio.run(router.choose_replicas([a, b], pinned("b")))] == [["b"]]
    # Serve's real replica ids carry the id string in unique_id
    real = FakeReplica(SimpleNamespace(unique_id="abc123"))
    assert asyncio.run(router.choose_replicas([a, real], pinned("abc123"))) == [[real]]
    # not (yet) listed: wait a little for it, then let anyone answer (and refuse at once)
    assert asyncio.run(router.choose_replicas([a], pinned("gone"))) == []
    assert asyncio.run(router.choose_replicas([a], pinned("gone", age_s=10.0))) == [[a]]
    assert asyncio.run(router.choose_replicas([], pinned("gone", age_s=10.0))) == []


def test_decode_router_prefers_room_then_low_load():
    router = _router(DecodeRequestRouter)
    full = FakeReplica("full", {"free_pages": 2, "num_pages": 100, "running": 0, "max_running": 8})
    busy = FakeReplica("busy", {"free_pages": 80, "num_pages": 100, "running": 7, "max_running": 8})
    idle = FakeReplica("idle", {"free_pages": 60, "num_pages": 100, "running": 1, "max_running": 8})
    ranked = asyncio.run(router.choose_replicas([full, busy, idle], pending(pages=10)))
    assert [[r.name for r in t] for t in ranked] == [["idle"], ["busy"], ["full"]]
    for i in range(7):
        router.on_request_routed(pending(pages=8, key=f"k{i}"), "idle", None)
    ranked = asyncio.run(router.choose_replicas([busy, idle], pending(pages=10)))
    assert ranked[0][0].name == "busy"  # idle's free pages after what we routed: 100 - 56 = 44, load 7/8 ~ busy
    ranked = asyncio.run(router.choose_replicas([busy, idle], pending(pages=50)))
    assert ranked[0][0].name == "busy"  # only busy has 50 pages


def test_decode_router_pins_calls_for_one_replica():
    """cancel_choice: stopping one choice of a group goes to the replica decoding the group."""
    import time

    router = _router(DecodeRequestRouter)
    roomy = FakeReplica("roomy", {"free_pages": 90, "num_pages": 100, "running": 0, "max_running": 8})
    held = FakeReplica("held", {"free_pages": 0, "num_pages": 100, "running": 8, "max_running": 8})
    call = SimpleNamespace(args=[], kwargs={"routing": routing_hint(replica="held")}, created_at=time.time(),
                           metadata=SimpleNamespace(internal_request_id="cancel"))
    assert asyncio.run(router.choose_replicas([roomy, held], call)) == [[held]]
    call.created_at -= 10.0  # gone for good: anyone answers (and finds no such choice)
    assert asyncio.run(router.choose_replicas([roomy], call)) == [[roomy]]


# ----------------------------------------------------------------------------- state, config
def test_request_lifecycle():
    life = RequestLifecycle("r")
    for phase in (RequestPhase.PREFILLING, RequestPhase.TRANSFERRING, RequestPhase.PREFILLING,
                  RequestPhase.TRANSFERRING, RequestPhase.DECODING, RequestPhase.FINISHED):
        life.to(phase)
    assert life.prefill_attempts == 2 and life.done
    with pytest.raises(IllegalTransition):
        life.to(RequestPhase.FAILED)
    life = RequestLifecycle("s")
    with pytest.raises(IllegalTransition):
        life.to(RequestPhase.DECODING)
    life.to(RequestPhase.CANCELLED)
    assert life.done


def test_service_config():
    cfg = ServiceConfig.from_dict({"sparse": {"alpha": 0.0}, "fault_injection": {"corrupt_transfers": 2}})
    assert cfg.sparse_config.alpha == 0.0 and cfg.fault_injection.corrupt_transfers == 2
    assert ServiceConfig.from_dict(cfg.to_dict()) == cfg and cfg.model_id == "builtin:smollm2-135m"
    for transport in ("auto", "object_store", "nccl", "cuda_ipc", "gloo"):
        assert ServiceConfig.from_dict({"transfer": {"transport": transport}}).transfer.transport == transport
    assert ServiceConfig.from_dict({"fault_injection": {"mode": "break"}}).fault_injection.mode == "break"
    for bad, path in (({"alpha": 2}, "sparse.alpha"), ({"transport": "carrier-pigeon"}, "transfer.transport"),
                      ({"kv": {"page_size": 0}}, "kv.page_size"), ({"bogus": 1}, "bogus"),
                      ({"sparse": {"block_size": 100}}, "sparse.block_size"),
                      ({"fault_injection": {"mode": "melt"}}, "fault_injection.mode"),
                      ({"debug_routing": "yes"}, "ingress.debug_routing"),
                      ({"runtime": {"fused_ops": "yes"}}, "runtime.fused_ops"),
                      ({"decode": {"cuda_graphs": 1}}, "decode.cuda_graphs"),
                      ({"prefill": {"prefix_caching": "on"}}, "prefill.prefix_caching")):
        with pytest.raises(ValueError, match=rf"^{path}: "):
            ServiceConfig.from_dict(bad)
    assert ServiceConfig().prefill.prefix_caching and not ServiceConfig(prefill={"prefix_caching": False}).prefill.prefix_caching


def test_service_config_is_frozen_picklable_and_a_plain_dict():
    import pickle

    cfg = ServiceConfig(prefill={"chunk_tokens": 512}, transfer={"channel": {"ring_depth": 2}},
                        ingress={"auth_token": "s3cret-token"})
    with pytest.raises(ValueError, match="frozen"):
        cfg.prefill.chunk_tokens = 8
    with pytest.raises(ValueError, match="frozen"):
        cfg.prefill = cfg.prefill
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(cfg) == hash(pickle.loads(pickle.dumps(cfg)))
    raw = cfg.to_dict()
    assert json.loads(json.dumps(raw)) == raw  # plain types only: travels as Serve args and constructor args
    assert raw["prefill"]["chunk_tokens"] == 512 and raw["transfer"]["channel"]["ring_depth"] == 2
    assert ServiceConfig.from_dict(raw) == cfg
    worker = ServiceConfig.from_dict(cfg.worker_dict())
    assert worker.ingress.auth_token is None and worker.replace(auth_token="s3cret-token") == cfg
    assert cfg.replace({"prefill.chunk_tokens": 256}).prefill.chunk_tokens == 256 and cfg.prefill.chunk_tokens == 512
    with pytest.raises(ValueError, match=r"^prefill.chunk_tokens: Input should be greater than or equal to 0"):
        cfg.replace(prefill_chunk_tokens=-1)
    assert ServiceConfig.from_dict(None) == ServiceConfig() and ServiceConfig.from_dict(cfg) is cfg
    with pytest.raises(ValueError, match="config: expected a mapping of options, got list"):
        ServiceConfig.from_dict([1])


def test_flat_names_are_aliases_of_the_nested_options():
    from serving.config import OPTION_ALIASES, OPTIONS

    assert set(OPTION_ALIASES.values()) <= set(OPTIONS) and len(set(OPTION_ALIASES.values())) == len(OPTION_ALIASES)
    flat = ServiceConfig.from_dict({"prefill_chunk_tokens": 4096, "alpha": 0.25, "max_batch_tokens": 8192,
                                    "prefill_kv_pages": 32, "model": "builtin:structured-tiny", "transport": "gloo"})
    nested = ServiceConfig.from_dict({"prefill": {"chunk_tokens": 4096, "max_batch_tokens": 8192},
                                      "sparse": {"alpha": 0.25}, "kv": {"prefill_pages": 32},
                                      "model": {"model": "builtin:structured-tiny"}, "transfer.transport": "gloo"})
    assert flat == nested and flat.prefill.chunk_tokens == 4096 and flat.model.model == "builtin:structured-tiny"
    assert ServiceConfig(prefill_chunk_tokens=4096, max_batch_tokens=8192) == ServiceConfig(
        prefill={"chunk_tokens": 4096, "max_batch_tokens": 8192})
    # the same value both ways is one option given twice, consistently
    assert ServiceConfig.from_dict({"alpha": 0.25, "sparse": {"alpha": 0.25}}).sparse.alpha == 0.25
    with pytest.raises(ValueError) as info:
        ServiceConfig.from_dict({"prefill_chunk_tokens": 4096, "prefill": {"chunk_tokens": 2048}})
    assert str(info.value) == ("prefill.chunk_tokens: given twice with different values, as prefill_chunk_tokens (4096) "
                               "and as prefill.chunk_tokens (2048); keep one (prefill_chunk_tokens is the old name of "
                               "prefill.chunk_tokens)")
    with pytest.raises(ValueError, match="kv.page_size: given twice with different values, as kv.page_size"):
        ServiceConfig.from_dict({"kv.page_size": 16, "page_size": 32})


@pytest.mark.parametrize("raw, message", [
    ({"nope": 1}, "nope: unknown section or option; (sections: model, kv,"),
    ({"prefil": {"chunk_tokens": 8}}, "prefil: unknown section or option; did you mean 'prefill'?"),
    ({"prefill": {"chunk_tokns": 8}}, "prefill.chunk_tokns: unknown option; did you mean 'chunk_tokens'? (prefill has: "),
    ({"transfer.channel.ring_dpth": 2}, "transfer.channel.ring_dpth: unknown option; did you mean 'ring_depth'?"),
    ({"prefill": 5}, "prefill: expected a mapping of options, got int 5"),
    ({"prefill": {"chunk_tokens": "8192"}}, "prefill.chunk_tokens: Input should be a valid integer, got '8192'"),
    ({"prefill": {"chunk_tokens": 1.5}}, "prefill.chunk_tokens: Input should be a valid integer, got 1.5"),
    ({"prefill": {"chunk_tokens": True}}, "prefill.chunk_tokens: Input should be a valid integer, got True"),
    ({"kv": {"scale_margin": float("nan")}}, "kv.scale_margin: Input should be less than or equal to"),
    ({"sparse": {"alpha": True}}, "sparse.alpha: Input should be a valid number, got True"),
    ({"model": {"weight_dtype": "int4"}}, "model.weight_dtype: Input should be 'auto', 'fp8_e4m3',"),
    ({"model": "builtin:nope"}, "model.model: expected one of"),
    ({"served_model_name": ""}, "model.served_model_name: String should have at least 1 character"),
    ({"transfer": {"channel": {"ring_depth": 9}}}, "transfer.channel.ring_depth: Input should be less than or equal to 8"),
    ({"transfer": {"ipc": {"idle_close_s": 0}}}, "transfer.ipc.idle_close_s: Input should be greater than 0"),
    ({"transfer": {"object_store": {"fetch_timeout_s": -1.0}}}, "transfer.object_store.fetch_timeout_s: Input should be"),
    ({3: 1}, "config: option names are strings, got 3"),
])
def test_config_errors_name_the_option_by_its_dotted_path(raw, message):
    with pytest.raises(ValueError) as info:
        ServiceConfig.from_dict(raw)
    assert str(info.value).startswith(message), str(info.value)


def test_every_bad_option_is_reported_and_a_section_alone_names_its_path():
    from serving.config import ConfigError, PrefillOptions

    with pytest.raises(ConfigError) as info:
        ServiceConfig.from_dict({"kv": {"page_size": 0}, "sparse": {"alpha": 2.0}})
    assert str(info.value).splitlines() == ["kv.page_size: Input should be greater than or equal to 1, got 0",
                                            "sparse.alpha: Input should be less than or equal to 1, got 2.0"]
    with pytest.raises(ConfigError, match=r"^prefill.chunk_tokens: Input should be greater than or equal to 0, got -1"):
        PrefillOptions(chunk_tokens=-1)


def test_channel_section_mirrors_channel_config():
    """transfer.channel holds every ChannelConfig field with ChannelConfig's defaults (plus the
    transport's thread count) and builds an equal ChannelConfig."""
    import dataclasses

    from kv_transfer.channel.config import ChannelConfig
    from serving.config import ChannelOptions

    names = [f.name for f in dataclasses.fields(ChannelConfig)]
    assert list(ChannelOptions.model_fields) == [*names, "max_workers"]
    assert ChannelOptions().channel_config() == ChannelConfig()
    custom = ServiceConfig.from_dict({"transfer.channel": {"chunk_bytes": 4096, "ring_depth": 1, "connect_timeout_s": 3.0}})
    assert custom.transfer.channel.channel_config() == ChannelConfig(chunk_bytes=4096, ring_depth=1, connect_timeout_s=3.0)


def test_decode_graphs_are_off_on_cpu_and_a_failed_capture_leaves_the_runner_eager():
    import torch

    from serving.runtime import WorkerRuntime

    rt = WorkerRuntime.build(ServiceConfig(), num_pages=4)
    assert rt.enable_decode_graphs() == "off: runs on cpu" and rt.runner.decode_graphs is None
    off = WorkerRuntime.build(ServiceConfig(decode={"cuda_graphs": False}), num_pages=4)
    assert off.enable_decode_graphs() == "off: cuda_graphs is False"
    rt.device = torch.device("cuda")  # as if on a GPU: the runner (on the CPU) refuses to capture
    status = rt.enable_decode_graphs()
    assert status.startswith("eager: capture failed: ValueError: capture: CUDA graphs need a CUDA runner")
    assert rt.decode_graphs == status and rt.runner.decode_graphs is None
    assert rt.pool.free_pages == rt.pool.num_pages  # nothing borrowed is kept


@pytest.mark.parametrize("fused_ops,expect", [(True, None), (False, False)])
def test_fused_ops_option_reaches_the_runner(monkeypatch, fused_ops, expect):
    """True leaves the choice to the runner (fused on CUDA), False forces the eager modules."""
    from model_executor import runner as runner_mod
    from serving.runtime import WorkerRuntime

    seen = []
    real = runner_mod.ModelRunner

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fused_ops", "missing"))
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "ModelRunner", spy)
    rt = WorkerRuntime.build(ServiceConfig(runtime={"fused_ops": fused_ops}), num_pages=4)
    assert seen == [expect] and rt.runner.fused_counts == {"rms_norm": 0, "silu_mul": 0, "rotary": 0}  # CPU: eager either way


# ----------------------------------------------------------------------------- structured models
def test_structured_models_are_seeded_and_speak_token_ids():
    import torch

    from model_executor.loading import (
        BUILTIN_STRUCTURED_8B, BUILTIN_STRUCTURED_TINY, load_model, load_tokenizer, structured_spec,
    )
    from model_executor.tokenizer import IdTokenizer

    a = load_model(BUILTIN_STRUCTURED_TINY, dtype=torch.float32, seed=3)
    torch.manual_seed(1234)  # the caller's RNG state does not matter ...
    b = load_model(BUILTIN_STRUCTURED_TINY, dtype=torch.float32, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    c = load_model(BUILTIN_STRUCTURED_TINY, dtype=torch.float32, seed=4)  # ... the seed does
    assert not torch.equal(a.model.lm_head.weight, c.model.lm_head.weight)
    assert not torch.equal(a.model.model.layers[0].mlp.up_proj.weight, c.model.model.layers[0].mlp.up_proj.weight)
    assert load_model(BUILTIN_STRUCTURED_TINY).model.lm_head.weight.dtype == torch.bfloat16  # default dtype
    assert torch.get_default_dtype() == torch.float32  # left as it was
    spec = structured_spec(BUILTIN_STRUCTURED_TINY)
    assert a.num_layers == spec.num_layers and a.tokenizer.vocab_size == spec.vocab_size == a.config.vocab_size
    # the 8B's tokenizer without its weights (what the ingress loads)
    tok8 = load_tokenizer(BUILTIN_STRUCTURED_8B)
    assert isinstance(tok8, IdTokenizer) and tok8.vocab_size == 128256 and tok8.bos_token_id == 128000
    assert tok8.stop_token_ids == () and tok8.eos_token_id is None  # generations always run to max_tokens
    assert tok8.encode("hi") == [128000, 2 + ord("h"), 2 + ord("i")] and tok8.encode("hi", add_bos=False) == [106, 107]
    assert tok8.decode([128000, 5, 77]) == "<5><77>" and tok8.decode([128000], skip_special_tokens=False) == "<128000>"


def test_structured_model_and_tokenizer_errors():
    from model_executor.loading import build_structured_model, load_model, load_tokenizer, structured_spec
    from model_executor.tokenizer import IdTokenizer

    for call in (lambda: load_model("builtin:nope"), lambda: load_tokenizer("builtin:nope"),
                 lambda: ServiceConfig.from_dict({"model": "builtin:structured-405b"})):
        with pytest.raises(ValueError, match="model: expected one of"):
            call()
    for call in (lambda: structured_spec("builtin:tiny"), lambda: build_structured_model("builtin:tiny")):
        with pytest.raises(ValueError, match="name: expected"):
            call()
    with pytest.raises(ValueError, match="vocab_size"):
        IdTokenizer(100)
    with pytest.raises(ValueError, match="vocab_size"):
        IdTokenizer(True)
    with pytest.raises(ValueError, match="bos_token_id"):
        IdTokenizer(4096, bos_token_id=4096)
    tok = IdTokenizer(4096, bos_token_id=1)
    with pytest.raises(ValueError, match="ids: token id 4096"):
        tok.decode([4096])
    with pytest.raises(ValueError, match="text"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_parser_with_the_id_tokenizer():
    from model_executor.tokenizer import IdTokenizer

    p = RequestParser(IdTokenizer(4096, bos_token_id=1), model_id="s", max_model_len=600, default_max_tokens=64)
    req = p.parse({"model": "s", "prompt": [1] + [7] * 499, "max_tokens": 64}, "completion")
    assert req.prompt_len == 500 and req.max_tokens == 64 and req.stop_token_ids == ()
    with pytest.raises(RequestError) as info:
        p.parse({"model": "s", "prompt": [1, 4096]}, "completion")
    assert info.value.param == "prompt" and info.value.status == 400
    with pytest.raises(RequestError) as info:
        p.parse({"model": "s", "messages": [{"role": "user", "content": "hi"}]}, "chat")
    assert info.value.param == "messages" and info.value.status == 400


# ----------------------------------------------------------------------------- chunked prefill option
def test_prefill_chunk_tokens_option():
    # on by default (issue 47: no head-of-line blocking); tests/test_cancellation.py has the default's rules
    assert ServiceConfig().prefill.chunk_tokens == ServiceConfig().prefill.chunk_size == 2048
    assert ServiceConfig().prefill.schedule == "shortest_first"
    assert ServiceConfig.from_dict({"prefill": {"chunk_tokens": 0}}).prefill.chunk_size is None  # 0: off
    assert ServiceConfig.from_dict({"prefill": {"chunk_tokens": None}}).prefill.chunk_size is None  # null: off
    cfg = ServiceConfig.from_dict({"prefill": {"chunk_tokens": 4096, "max_batch_tokens": 8192}})
    assert cfg.prefill.chunk_size == 4096 and ServiceConfig.from_dict(cfg.to_dict()) == cfg
    for bad in (-1, True, "8192", 1.5):
        with pytest.raises(ValueError, match=r"^prefill.chunk_tokens: Input should be"):
            ServiceConfig.from_dict({"prefill": {"chunk_tokens": bad}})
    with pytest.raises(ValueError, match=r"^prefill.chunk_tokens: expected at most prefill.max_batch_tokens \(8192\), got 16384"):
        ServiceConfig.from_dict({"prefill": {"chunk_tokens": 16384}})


def test_kv_cache_dtype_option():
    assert ServiceConfig().kv.cache_dtype == "auto"
    cfg = ServiceConfig.from_dict({"kv": {"cache_dtype": "fp8_e4m3", "scale_margin": 4.0}})
    assert ServiceConfig.from_dict(cfg.to_dict()) == cfg
    for bad in ("fp8", "float8_e4m3fn", None, 8):
        with pytest.raises(ValueError, match=r"^kv.cache_dtype: Input should be 'auto' or 'fp8_e4m3'"):
            ServiceConfig.from_dict({"kv": {"cache_dtype": bad}})
    for bad in (0.5, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match=r"^kv.scale_margin: Input should be"):
            ServiceConfig.from_dict({"kv": {"scale_margin": bad}})


def test_fp8_replicas_calibrate_identical_scales_and_prefill():
    """Two prefill replicas and a decode replica of one FP8 service build equal pool scales
    (KV transfer checks them), and a prompt prefills through the FP8 pool."""
    from decode_worker.deployment import DecodeServer
    from model_executor.sampling import SamplingParams
    from prefill_worker.deployment import PrefillServer
    from prefill_worker.engine import PrefillRequest

    opts = {"kv_cache_dtype": "fp8_e4m3", "alpha": 0.0, "torch_threads": 1, "prefill_kv_pages": 48,
            "decode_kv_pages": 48}
    servers = [PrefillServer(opts), PrefillServer(opts), DecodeServer(opts)]
    pools = [srv.runtime.pool for srv in servers]
    assert all(p.dtype == torch.float8_e4m3fn for p in pools)
    for p in pools[1:]:
        assert torch.equal(p.k_scale, pools[0].k_scale) and torch.equal(p.v_scale, pools[0].v_scale)
    engine = servers[0].engine
    (res,) = engine.prefill([PrefillRequest("a", [256] + list(range(40)), SamplingParams(temperature=0.0))])
    assert res.kv_len == 41 and 0 <= res.first_token < 259
    engine.release("a")
    assert pools[0].free_pages == pools[0].num_pages


def test_prefill_replica_prefills_in_chunks_of_prefill_chunk_tokens():
    """The option reaches the engine: a 100-token prompt in chunks of 32 takes 4 forwards and
    gives the same first token as a whole-prompt prefill (dense, so exactly the same math)."""
    from model_executor.sampling import SamplingParams
    from prefill_worker.deployment import PrefillServer
    from prefill_worker.engine import PrefillRequest

    prompt = [256] + [(i * 7) % 256 for i in range(99)]
    firsts = {}
    for chunk in (None, 32):
        server = PrefillServer({"prefill_chunk_tokens": chunk, "alpha": 0.0, "torch_threads": 1,
                                "prefill_kv_pages": 16, "decode_kv_pages": 16})
        assert server.engine.chunk_size == chunk
        (result,) = server.engine.prefill([PrefillRequest("r", prompt, SamplingParams(temperature=0.0))])
        firsts[chunk] = result.first_token
        assert server.engine.forward_batches == (1 if chunk is None else 4)
        server.engine.release("r")
    assert firsts[None] == firsts[32]


def test_default_worker_gpus_and_transport_on_a_shared_gpu():
    """With one GPU, prefill and decode share it (half each) and ``auto`` stays ``auto`` (CUDA
    IPC moves their pages; before, it was forced to the object store); with two or more GPUs,
    one GPU each."""
    from router.app import _default_worker_options, build_application

    cfg = ServiceConfig()
    one = _default_worker_options(cfg, cluster_gpus=1)
    two = _default_worker_options(cfg, cluster_gpus=2)
    none = _default_worker_options(cfg, cluster_gpus=0)
    assert one["ray_actor_options"]["num_gpus"] == 0.5
    assert two["ray_actor_options"]["num_gpus"] == 1.0
    assert none["ray_actor_options"]["num_gpus"] == 0.0
    cpu, cuda = ServiceConfig(model={"device": "cpu"}), ServiceConfig(model={"device": "cuda"})
    assert _default_worker_options(cpu, cluster_gpus=4)["ray_actor_options"]["num_gpus"] == 0.0
    assert _default_worker_options(cuda, cluster_gpus=0)["ray_actor_options"]["num_gpus"] == 1.0
    app = build_application(cfg, prefill=one, decode=one)
    prefill_app, decode_app, raw = app._bound_deployment.init_args
    assert raw["transfer"]["transport"] == "auto"
    assert prefill_app._bound_deployment.init_args[0]["transfer"]["transport"] == "auto"
    assert decode_app._bound_deployment.init_args[0]["transfer"]["transport"] == "auto"


def test_cuda_ipc_wiring_of_the_worker_deployments(monkeypatch):
    """What each transport choice builds in the replicas (the CUDA choices forced onto CPU
    pools: the fallback channel is then gloo), and the prefill replica's stage_pages."""
    import decode_worker.deployment as dd
    import kv_transfer.choice as choice
    import prefill_worker.deployment as pd
    from kv_transfer.channel.recv import ChannelReceiver
    from kv_transfer.channel.send import ChannelSender
    from kv_transfer.cuda_ipc.recv import CudaIpcReceiver
    from kv_transfer.cuda_ipc.send import CudaIpcSender
    from kv_transfer.transfer import IPC_OR_NCCL

    opts = {"alpha": 0.0, "torch_threads": 1, "prefill_kv_pages": 16, "decode_kv_pages": 16, "lease_timeout_s": 42.0,
            "transfer": {"channel": {"chunk_bytes": 4096, "ring_depth": 2, "connect_timeout_s": 7.0},
                         "ipc": {"copy_chunk_bytes": 8192, "idle_close_s": 9.0, "stage_timeout_s": 11.0},
                         "object_store": {"fetch_timeout_s": 13.0}}}
    for kind in (IPC_OR_NCCL, "cuda_ipc"):
        monkeypatch.setattr(choice, "select_transport", lambda requested, device, kind=kind: kind)
        pre, dec = pd.PrefillServer(opts), dd.DecodeServer(opts)
        try:
            ipc = pre.transport
            assert type(ipc) is CudaIpcSender and ipc.lease_timeout_s == 42.0
            receiver = dec.receivers["cuda_ipc"]
            assert type(receiver) is CudaIpcReceiver  # the transfer.ipc knobs are the receiver's
            assert (receiver.copy_chunk_bytes, receiver.idle_close_s, receiver.stage_timeout_s) == (8192, 9.0, 11.0)
            assert pre.object_store.fetch_timeout_s == 13.0 and dec.receivers["object_store"].fetch_timeout_s == 13.0
            stats = pre.record_routing_stats()
            assert stats["ipc_exports"] == 0 and stats["ipc_exported"] == 0
            assert isinstance(stats["attention_kernels"], dict)  # kernels.ops' counts, by kernel
            request = StagePages(request_id="r", sender_id=ipc.replica_id, transport="gloo")
            reply = asyncio.run(pre.stage_pages(request))
            if kind == IPC_OR_NCCL:
                # each end's fallback is its end of the channel: a sender here, a receiver there
                assert type(ipc.fallback) is ChannelSender and ipc.serves_sends
                assert type(dec.receivers["gloo"]) is ChannelReceiver
                for channel in (ipc.fallback, dec.receivers["gloo"]):  # the transfer.channel knobs
                    assert (channel.config.chunk_bytes, channel.config.ring_depth, channel.config.connect_timeout_s) \
                        == (4096, 2, 7.0)
                assert set(dec.receivers) == {"object_store", "cuda_ipc", "gloo"}
                assert receiver.fallback is dec.receivers["gloo"]
                # one client of the prefill replicas: its stage and send calls
                assert receiver.call_sender == dec.prefill.stage_pages
                assert dec.receivers["gloo"].call_sender == dec.prefill.send_pages
                assert "channel_sends" in stats and "channel_receives" in dec.record_routing_stats()
                assert reply.ok is False and reply.reason == "lost"  # no such lease
            else:
                assert ipc.fallback is None and not ipc.serves_sends
                assert set(dec.receivers) == {"object_store", "cuda_ipc"} and receiver.fallback is None
                assert reply.ok is False and reply.reason == "unavailable"
                reply = asyncio.run(pre.send_pages({}))
                assert reply.ok is False and "not over channels" in reply.message
            dec.check_health()
            receiver.device_error = "CUDA error: an illegal memory access was encountered"
            with pytest.raises(RuntimeError, match="illegal memory access"):
                dec.check_health()
        finally:
            pre.transport.close()
            for r in dec.receivers.values():
                r.close()
    monkeypatch.undo()
    pre = pd.PrefillServer({**opts, "transport": "object_store"})
    reply = asyncio.run(pre.stage_pages(StagePages(request_id="r", sender_id="x", transport="nccl")))
    assert reply.ok is False and reply.reason == "unavailable" and "object_store" in reply.message


def _prefixed(cost, pages, prefix, key):
    return SimpleNamespace(args=[], kwargs={"routing": routing_hint(cost=cost, pages=pages, prefix=prefix)},
                           metadata=SimpleNamespace(internal_request_id=key))


def test_prefix_hint_digests_every_stride_pages_with_the_cached_cost():
    from router.scheduling import prefix_hint

    model = PrefillCostModel(token_weight=0.0, dense_below=0, expected_density=1.0)
    tokens = list(range(1000, 1000 + 20 * 64 + 10))  # 20 full pages of 64 + 10 tokens
    hint = prefix_hint(tokens, 64, model, stride=8)
    assert len(hint) == 9 and all(len(d) == 16 for d, _ in hint)  # pages 1..8, then 16: 8 bytes in hex
    n = len(tokens)
    assert [c for _, c in hint] == [model.cost(n, i * 64) for i in (1, 2, 3, 4, 5, 6, 7, 8, 16)]
    other = prefix_hint(tokens[:8 * 64] + [7] * (12 * 64 + 10), 64, model, stride=8)
    assert [d for d, _ in other[:8]] == [d for d, _ in hint[:8]] and other[8][0] != hint[8][0]
    assert len(prefix_hint(tokens[:100], 64, model, stride=8)) == 1  # one full page
    assert prefix_hint(tokens[:63], 64, model) == []  # no full page: no hint
    # the engine reuses whole pages of all but the last token: a one-page prompt reuses nothing
    assert prefix_hint(tokens[:64], 64, model)[0][1] == model.cost(64, 0)
    # with sparse prefill it reuses whole 128-token tiles: page 3 (192 tokens) saves 128
    tiled = prefix_hint(tokens, 64, model, granule=128)
    assert tiled[2][1] == model.cost(n, 128) and tiled[3][1] == model.cost(n, 256)


def test_prefill_router_prefers_the_replica_that_has_the_prefix_unless_it_is_much_busier():
    router = _router(PrefillRequestRouter)
    a = FakeReplica("a", {"outstanding_cost": 0.0, "free_pages": 100})
    b = FakeReplica("b", {"outstanding_cost": 0.0, "free_pages": 100})
    prefix = [["d1", 600.0], ["d2", 200.0]]  # full cost 1000; 200 if all of d2 is cached
    first = _prefixed(1000.0, 5, prefix, "first")
    router.on_request_routed(first, "b", None)
    router.on_request_completed("b", "first")
    ranked = asyncio.run(router.choose_replicas([a, b], _prefixed(1000.0, 5, prefix, "again")))
    assert [[r.name for r in t] for t in ranked] == [["b"], ["a"]]  # 0 + 200 beats 0 + 1000
    # routed there, it adds only its uncached cost to b's outstanding work
    router.on_request_routed(_prefixed(1000.0, 5, prefix, "again"), "b", None)
    assert router.outstanding(b) == 200.0
    router.on_request_completed("b", "again")
    # a shorter shared prefix still counts: d1 only
    ranked = asyncio.run(router.choose_replicas([a, b], _prefixed(1000.0, 5, [["d1", 600.0], ["zz", 100.0]], "c")))
    assert ranked[0] == [b]
    # b busy by more than the saving: a goes first
    b.routing_stats["outstanding_cost"] = 5000.0
    ranked = asyncio.run(router.choose_replicas([a, b], _prefixed(1000.0, 5, prefix, "d")))
    assert ranked[0] == [a]
    # a replica that died is forgotten
    b.routing_stats["outstanding_cost"] = 0.0
    router._prefixes.forget_replica("b")
    ranked = asyncio.run(router.choose_replicas([a, b], _prefixed(1000.0, 5, prefix, "e")))
    assert sorted(r.name for r in ranked[0]) == ["a", "b"]


def test_prefix_index_is_bounded_lru():
    from router.scheduling import _PrefixIndex

    index = _PrefixIndex(max_entries=3)
    index.add(["p", "q", "r"], "x")
    index.add(["p"], "y")  # p is the newest now
    index.add(["s"], "x")  # evicts q, the least recently touched
    assert len(index) == 3
    assert index.cost_on("x", [["q", 1.0]], 9.0) == 9.0 and index.cost_on("y", [["p", 2.0]], 9.0) == 2.0


def test_usage_reports_cached_prompt_tokens_within_the_prompt():
    from router.usage import usage

    assert usage(10, 3) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert usage(10, 3, 8)["prompt_tokens_details"] == {"cached_tokens": 8}
    # after a decode resume the re-prefilled context (prompt + tokens so far) may be cached beyond the prompt
    assert usage(10, 3, 12)["prompt_tokens_details"] == {"cached_tokens": 10}


@pytest.mark.parametrize("body, kind, param", [
    ({"model": "m", "prompt": "a\ud800b"}, "completion", "prompt"),
    ({"model": "m", "prompt": ["\udfff"]}, "completion", "prompt"),
    ({"model": "m", "prompt": "hi", "stop": ["ok", "\ud801"]}, "completion", "stop"),
    ({"model": "m\ud800", "prompt": "hi"}, "completion", "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}, "chat", "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]}, "chat",
     "messages[0].content[0].text"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "chat", "messages[0].name"),
])
def test_lone_surrogates_are_400s_naming_the_field(body, kind, param):
    with pytest.raises(RequestError) as err:
        parser().parse(body, kind)
    e = err.value
    assert e.status == 400 and e.param == param and e.message.startswith(f"{param}: invalid Unicode")
    assert "codec" not in e.message and e.message.encode("utf-8")  # renderable: no surrogate left


def test_an_error_quoting_a_surrogate_renders():
    """An unknown field whose name holds a lone surrogate (ingress.strict_fields): the error
    names it, escaped."""
    strict = RequestParser(ByteTokenizer(), model_id="m", max_model_len=64, default_max_tokens=16, strict_fields=True)
    with pytest.raises(RequestError) as err:
        strict.parse({"model": "m", "prompt": "hi", "\ud800k": 1}, "completion")
    e = err.value
    assert e.param == "\\ud800k" and e.message.startswith("\\ud800k: unrecognized request argument")
    from router.app import error_response

    body = json.loads(error_response(e).body)
    assert body["error"]["param"] == "\\ud800k"


def test_weight_dtype_option_reaches_the_worker_model():
    """ServiceConfig.weight_dtype quantizes the replica's linear layers on load (the FP8 path of
    model_executor/fp8_linear.py, emulated on CPU); the default keeps the checkpoint's weights."""
    from model_executor import Fp8Linear
    from serving.runtime import WorkerRuntime

    def fp8_layers(cfg):
        rt = WorkerRuntime.build(cfg, num_pages=4)
        return [m for m in rt.runner.model.modules() if isinstance(m, Fp8Linear)]

    assert fp8_layers(ServiceConfig()) == []
    layers = fp8_layers(ServiceConfig(weight_dtype="fp8_channel"))
    assert layers and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    with pytest.raises(ValueError, match="weight_dtype"):
        ServiceConfig(weight_dtype="int4")
