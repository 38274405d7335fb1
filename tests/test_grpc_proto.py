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
_TYPE_NAMES = {"string": 9, "int32": 5, "uint32": 13, "uint64": 4, "float": 2, "bool": 8, "message": 11}


def test_existing_fields_keep_their_numbers_and_types():
    for message, fields in _OLD_FIELDS.items():
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
    for i in range(n_msgs):
        req.messages.add(role=text(f"messages[{i}].role"), content=text(f"messages[{i}].content"))
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
              *(f"messages[{i}].{f}" for i in range(n_msgs) for f in ("role", "content")),
              *(f"stop[{i}]" for i in range(n_stop)), "response_format.type", "response_format.pattern",
              *(f"response_format.choices[{i}]" for i in range(n_choices)), "response_format.json_schema.name",
              "response_format.json_schema.description",
              "response_format.json_schema." + rf.json_schema.WhichOneof("schema_source")]
    return req, places


def test_a_string_that_is_not_utf8_is_traced_to_its_field():
    rng = random.Random(20261202)
    seen = set()
    for _ in range(300):
        seed = rng.randrange(2**32)
        _, places = _random_request(random.Random(seed), "")
        where = rng.choice(places)
        marked, _ = _random_request(random.Random(seed), where)  # the same draws: the same request, marked
        parsed = parse_generate_request(_corrupt(marked))
        assert isinstance(parsed, MalformedMessage) and parsed.field == where, (where, parsed)
        assert parse_generate_request(marked.SerializeToString()) == marked  # intact: parses
        seen.add(re.sub(r"\[\d+\]", "[]", where))
    assert len(seen) >= 12, seen  # every kind of string field was hit


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
