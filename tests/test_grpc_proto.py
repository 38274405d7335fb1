"""The gRPC contract without a service: the committed stubs are what the ``.proto`` generates
(and import under the oldest protobuf ``scripts/setup.sh`` allows), fields that existed keep
their numbers and types (wire compatibility), and a string that is not UTF-8 is traced to the
field that holds it."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

pytest.importorskip("google.protobuf")

from router.grpc_service import MalformedMessage, bad_utf8_field, parse_generate_request  # noqa: E402
from router.proto import flashprefill_pb2 as pb  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "router" / "proto"


def test_committed_stubs_are_what_the_proto_generates(tmp_path):
    pytest.importorskip("grpc_tools")  # the dev extra
    from importlib.metadata import version

    from router.__main__ import gen_proto

    pinned = re.search(r'"grpcio-tools==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned, "pyproject.toml's dev extra pins no grpcio-tools version"
    if version("grpcio-tools") != pinned.group(1):  # another generator writes other bytes (and version guard)
        pytest.skip(f"grpcio-tools {version('grpcio-tools')} is not the pinned {pinned.group(1)}")

    assert gen_proto(str(tmp_path)) == 0
    for name in ("flashprefill_pb2.py", "flashprefill_pb2_grpc.py"):
        fresh = (tmp_path / "router" / "proto" / name).read_text()
        assert fresh == (PROTO_DIR / name).read_text(), f"{name} is stale: run `python -m router gen-proto`"


def test_stub_version_guard_allows_the_pinned_protobuf():
    """Generated code refuses a protobuf runtime older than the generator: it must not be newer
    than the oldest protobuf scripts/setup.sh installs."""
    text = (PROTO_DIR / "flashprefill_pb2.py").read_text()
    guard = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
                      text)
    assert guard, "no version guard found in flashprefill_pb2.py"
    pinned = re.search(r'"protobuf>=(\d+)\.(\d+)\.(\d+)"', (ROOT / "scripts" / "setup.sh").read_text())
    assert pinned, "scripts/setup.sh pins no protobuf minimum"
    assert tuple(map(int, guard.groups())) <= tuple(map(int, pinned.groups()))


# (message, field) -> (number, type, repeated) of every field the first released API had
_OLD_FIELDS = {
    "GenerateRequest": {
        "model": (1, "string", False), "prompt": (2, "string", False), "prompt_token_ids": (3, "int32", True),
        "messages": (4, "message", True), "max_tokens": (5, "uint32", False), "temperature": (6, "float", False),
        "top_p": (7, "float", False), "top_k": (8, "int32", False), "stop": (9, "string", True),
        "seed": (10, "uint64", False), "request_id": (11, "string", False), "presence_penalty": (12, "float", False),
        "frequency_penalty": (13, "float", False), "repetition_penalty": (14, "float", False),
        "logit_bias": (15, "message", True), "min_tokens": (16, "uint32", False), "stop_token_ids": (17, "int32", True),
        "ignore_eos": (18, "bool", False), "logprobs": (19, "uint32", False), "echo": (20, "bool", False),
        "sparse_attention": (21, "message", False),
    },
    "GenerateResponse": {
        "request_id": (1, "string", False), "model": (2, "string", False), "text": (3, "string", False),
        "token_ids": (4, "int32", True), "finish_reason": (5, "string", False), "usage": (6, "message", False),
        "timing": (7, "message", False), "routing": (8, "message", False), "logprobs": (9, "message", True),
        "system_fingerprint": (10, "string", False), "prompt_logprobs": (11, "message", True),
    },
    "GenerateStreamResponse": {
        "request_id": (1, "string", False), "text": (2, "string", False), "token_ids": (3, "int32", True),
        "finish_reason": (4, "string", False), "usage": (5, "message", False), "timing": (6, "message", False),
        "routing": (7, "message", False), "logprobs": (8, "message", True), "system_fingerprint": (9, "string", False),
        "prompt_logprobs": (10, "message", True),
    },
    "Usage": {"prompt_tokens": (1, "uint32", False), "completion_tokens": (2, "uint32", False),
              "total_tokens": (3, "uint32", False), "cached_tokens": (4, "uint32", False),
              "prompt_tokens_details": (5, "message", False), "sparse_attention": (6, "message", False)},
}
# fields added since (gRPC parity: choices, prompt lists, formats, tool calls), pinned as released
_ADDED_FIELDS = {
    "GenerateRequest": {"prompts": (22, "message", True), "n": (23, "uint32", False),
                        "best_of": (24, "uint32", False), "response_format": (25, "message", False),
                        "tools": (26, "message", True), "tool_choice": (27, "message", False),
                        "parallel_tool_calls": (28, "bool", False), "min_p": (29, "float", False),
                        "add_special_tokens": (30, "bool", False)},
    "ChatMessage": {"role": (1, "string", False), "content": (2, "string", False), "name": (3, "string", False),
                    "tool_call_id": (4, "string", False), "tool_calls": (5, "message", True)},
    "GenerateResponse": {"choices": (12, "message", True), "tool_calls": (13, "message", True)},
    "GenerateStreamResponse": {"index": (11, "uint32", False), "tool_calls": (12, "message", True)},
    "Choice": {"index": (1, "uint32", False), "text": (2, "string", False), "token_ids": (3, "int32", True),
               "finish_reason": (4, "string", False), "logprobs": (5, "message", True),
               "prompt_logprobs": (6, "message", True), "tool_calls": (7, "message", True)},
    "ToolCall": {"id": (1, "string", False), "type": (2, "string", False), "function": (3, "message", False)},
    "FunctionCall": {"name": (1, "string", False), "arguments": (2, "string", False)},
    "Tool": {"type": (1, "string", False), "function": (2, "message", False)},
    "FunctionDefinition": {"name": (1, "string", False), "description": (2, "string", False),
                           "parameters_json": (3, "string", False), "parameters": (4, "message", False),
                           "strict": (5, "bool", False)},
    "ToolChoice": {"mode": (1, "string", False), "function": (2, "message", False)},
    "NamedFunction": {"name": (1, "string", False)},
    "ListModelsResponse": {"models": (1, "message", True)},
    "Model": {"id": (1, "string", False), "created": (2, "int64", False), "owned_by": (3, "string", False),
              "max_model_len": (4, "int64", False)},  # the context, as /v1/models reports it
}
_TYPE_NAMES = {"string": 9, "int32": 5, "uint32": 13, "uint64": 4, "float": 2, "bool": 8, "message": 11, "int64": 3}


def test_existing_fields_keep_their_numbers_and_types():
    for message, fields in [*_OLD_FIELDS.items(), *_ADDED_FIELDS.items()]:
        descriptor = getattr(pb, message).DESCRIPTOR
        for name, (number, type_name, repeated) in fields.items():
            fd = descriptor.fields_by_name[name]
            assert (fd.number, fd.type, fd.is_repeated) == (number, _TYPE_NAMES[type_name], repeated), (message, name)
        numbers = [f.number for f in descriptor.fields]
        assert len(numbers) == len(set(numbers))


def test_new_fields_exist_as_documented():
    req = pb.GenerateRequest(prompts=[pb.Prompt(text="a"), pb.Prompt(token_ids=[1, 2])], n=2, best_of=3,
                             response_format=pb.ResponseFormat(type="json_schema", json_schema=pb.JsonSchema(
                                 name="x", schema_json="{}", strict=True)))
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req and back.HasField("n") and not pb.GenerateRequest().HasField("n")
    assert back.response_format.json_schema.WhichOneof("schema_source") == "schema_json"
    resp = pb.GenerateResponse(choices=[pb.Choice(index=1, text="t", token_ids=[3], finish_reason="stop")])
    assert pb.GenerateResponse.FromString(resp.SerializeToString()).choices[0].index == 1
    assert pb.GenerateStreamResponse(index=3).index == 3
    # tool calling: unset optional fields are HTTP's absent ones
    req = pb.GenerateRequest(tools=[pb.Tool(function=pb.FunctionDefinition(name="f", parameters_json="{}"))],
                             tool_choice=pb.ToolChoice(function=pb.NamedFunction(name="f")), parallel_tool_calls=False)
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req and back.HasField("parallel_tool_calls") and not back.parallel_tool_calls
    assert not pb.GenerateRequest().HasField("parallel_tool_calls") and not pb.GenerateRequest().HasField("tool_choice")
    assert back.tool_choice.WhichOneof("choice") == "function"
    assert back.tools[0].function.WhichOneof("parameters_source") == "parameters_json"
    assert not back.tools[0].function.HasField("strict") and not back.tools[0].function.HasField("description")
    assert not pb.ChatMessage(role="user").HasField("name")
    call = pb.ToolCall(id="call_1", type="function", function=pb.FunctionCall(name="f", arguments="{}"))
    resp = pb.GenerateResponse(tool_calls=[call], choices=[pb.Choice(tool_calls=[call])])
    assert pb.GenerateResponse.FromString(resp.SerializeToString()) == resp


# ----------------------------------------------------------------------------- invalid UTF-8
_MARK = "\u0800"  # E0 A0 80 in UTF-8; a lone surrogate U+D800 would be ED A0 80: same length
_SURROGATE = b"\xed\xa0\x80"


def _corrupt(msg) -> bytes:
    raw = msg.SerializeToString()
    assert raw.count(_MARK.encode()) == 1
    return raw.replace(_MARK.encode(), _SURROGATE)


def _random_request(rng: random.Random, where: str):
    """A request with random strings everywhere, the one at ``where`` holding the mark."""
    def text(path: str) -> str:
        s = "".join(rng.choice("abcdé€ ") for _ in range(rng.randint(1, 6)))
        return s[:1] + _MARK + s[1:] if path == where else s

    req = pb.GenerateRequest(model=text("model"), request_id=text("request_id"))
    n_prompts, n_msgs, n_stop, n_choices = (rng.randint(1, 3) for _ in range(4))
    for i in range(n_prompts):
        req.prompts.add(text=text(f"prompts[{i}].text"))
    msg_places = []
    for i in range(n_msgs):
        m = req.messages.add(role=text(f"messages[{i}].role"), content=text(f"messages[{i}].content"),
                             name=text(f"messages[{i}].name"), tool_call_id=text(f"messages[{i}].tool_call_id"))
        msg_places += [f"messages[{i}].{f}" for f in ("role", "content", "name", "tool_call_id")]
        for j in range(rng.randint(0, 2)):
            at = f"messages[{i}].tool_calls[{j}]"
            m.tool_calls.add(id=text(f"{at}.id"), type=text(f"{at}.type"), function=pb.FunctionCall(
                name=text(f"{at}.function.name"), arguments=text(f"{at}.function.arguments")))
            msg_places += [f"{at}.{f}" for f in ("id", "type", "function.name", "function.arguments")]
    tool_places = []
    for i in range(rng.randint(1, 3)):
        at = f"tools[{i}]"
        fn = req.tools.add(type=text(f"{at}.type")).function
        fn.name, fn.description = text(f"{at}.function.name"), text(f"{at}.function.description")
        if rng.random() < 0.5:
            fn.parameters_json = text(f"{at}.function.parameters_json")
        else:
            fn.parameters.update({"properties": {text(f"{at}.function.parameters"): {"maxLength": 3.0}}})
        tool_places += [f"{at}.{f}" for f in ("type", "function.name", "function.description")]
        tool_places.append(f"{at}.function.{fn.WhichOneof('parameters_source')}")
    if rng.random() < 0.5:
        req.tool_choice.mode = text("tool_choice.mode")
    else:
        req.tool_choice.function.name = text("tool_choice.function.name")
    req.stop.extend(text(f"stop[{i}]") for i in range(n_stop))
    req.logit_bias[rng.randrange(300)] = 1.5
    rf = req.response_format
    rf.type = text("response_format.type")
    rf.pattern = text("response_format.pattern")
    rf.choices.extend(text(f"response_format.choices[{i}]") for i in range(n_choices))
    rf.json_schema.name = text("response_format.json_schema.name")
    rf.json_schema.description = text("response_format.json_schema.description")
    if rng.random() < 0.5:
        rf.json_schema.schema_json = text("response_format.json_schema.schema_json")
    else:
        rf.json_schema.schema.update({"k": [text("response_format.json_schema.schema"), {"d": 1.0}]})
    places = ["model", "request_id", *(f"prompts[{i}].text" for i in range(n_prompts)),
              *msg_places, *tool_places,
              "tool_choice." + ("mode" if req.tool_choice.WhichOneof("choice") == "mode" else "function.name"),
              *(f"stop[{i}]" for i in range(n_stop)), "response_format.type", "response_format.pattern",
              *(f"response_format.choices[{i}]" for i in range(n_choices)), "response_format.json_schema.name",
              "response_format.json_schema.description",
              "response_format.json_schema." + rf.json_schema.WhichOneof("schema_source")]
    return req, places


def test_a_string_that_is_not_utf8_is_traced_to_its_field():
    rng = random.Random(20261202)
    seen = set()
    for _ in range(600):
        seed = rng.randrange(2**32)
        _, places = _random_request(random.Random(seed), "")
        where = rng.choice(places)
        marked, _ = _random_request(random.Random(seed), where)  # the same draws: the same request, marked
        parsed = parse_generate_request(_corrupt(marked))
        assert isinstance(parsed, MalformedMessage) and parsed.field == where, (where, parsed)
        assert parse_generate_request(marked.SerializeToString()) == marked  # intact: parses
        seen.add(re.sub(r"\[\d+\]", "[]", where))
    assert len(seen) == 26, seen  # every kind of string field was hit


def test_a_tool_field_that_is_not_utf8_is_named():
    """The fields of tool calling, as a client would fill them (the random test above mixes all)."""
    tools = [pb.Tool(type="function", function=pb.FunctionDefinition(name="ok", parameters_json="{}")),
             pb.Tool(function=pb.FunctionDefinition(name="f" + _MARK))]
    req = pb.GenerateRequest(model="m", tools=tools, tool_choice=pb.ToolChoice(mode="required"))
    req.messages.add(role="user", content="hi")
    assert parse_generate_request(_corrupt(req)).field == "tools[1].function.name"
    req.tools[1].function.name = "f"
    req.tools[1].function.parameters.update({"properties": {"a" + _MARK: {"type": "string"}}})
    assert parse_generate_request(_corrupt(req)).field == "tools[1].function.parameters"  # inside a Struct
    req.tools[1].function.ClearField("parameters")
    turn = req.messages.add(role="assistant")
    turn.tool_calls.add(id="c1", function=pb.FunctionCall(name="ok", arguments='{"a": 1}'))
    turn.tool_calls.add(id="c2", function=pb.FunctionCall(name="ok", arguments='{"a": "' + _MARK + '"}'))
    assert parse_generate_request(_corrupt(req)).field == "messages[1].tool_calls[1].function.arguments"
    turn.tool_calls[1].function.arguments = "{}"
    req.messages.add(role="tool", content="r", tool_call_id="c" + _MARK)
    assert parse_generate_request(_corrupt(req)).field == "messages[2].tool_call_id"
    req.messages[2].tool_call_id = "c1"
    req.tool_choice.function.name = "ok" + _MARK
    assert parse_generate_request(_corrupt(req)).field == "tool_choice.function.name"
    req.tool_choice.function.name = "ok"
    assert parse_generate_request(req.SerializeToString()) == req


def test_bytes_that_are_no_message_name_no_field():
    assert bad_utf8_field(b"\x0a\xff\xff\xff\xff\x0f") is None  # a length running past the end
    assert bad_utf8_field(pb.GenerateRequest(model="ok", prompt="fine").SerializeToString()) is None
    bad = parse_generate_request(b"\x12\xff\xff\xff\x0f")
    assert isinstance(bad, MalformedMessage) and bad.field is None
    # an unknown field number holding non-UTF-8 bytes is not ours to name
    assert bad_utf8_field(b"\xfa\x3e\x03" + _SURROGATE) is None


def test_health_request_that_is_not_utf8_names_the_service_field():
    health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
    from router.grpc_service import parse_health_request

    raw = health_pb2.HealthCheckRequest(service="a" + _MARK).SerializeToString().replace(_MARK.encode(), _SURROGATE)
    bad = parse_health_request(raw)
    assert isinstance(bad, MalformedMessage) and bad.field == "service"
    assert parse_health_request(b"\xff\xff\xff").field is None
