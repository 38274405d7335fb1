"""``python -m router client "prompt"``: a small client for the HTTP (OpenAI) and gRPC APIs.

Uses only the standard library for HTTP (server-sent events parsed line by line) and the
committed stubs for gRPC. Prints the reply as it streams, then usage and timing on stderr.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ClientResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    timing: dict | None = None
    routing: dict | None = None
    choices: list[dict] = field(default_factory=list)  # every choice: index, text, token_ids, finish_reason


class HttpClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict):
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        return urllib.request.urlopen(req, timeout=self.timeout_s)

    def model(self) -> str:
        with urllib.request.urlopen(self.base_url + "/v1/models", timeout=self.timeout_s) as resp:
            return json.load(resp)["data"][0]["id"]

    def generate(self, body: dict, *, chat: bool = False) -> ClientResult:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        with self._post(path, {**body, "stream": False}) as resp:
            obj = json.load(resp)
        choices = [{"index": c["index"], "text": c["message"]["content"] if chat else c["text"],
                    "token_ids": c.get("token_ids", []), "finish_reason": c["finish_reason"]} for c in obj["choices"]]
        first = choices[0]
        return ClientResult(first["text"], first["token_ids"], first["finish_reason"], obj.get("usage"),
                            obj.get("timing"), obj.get("routing"), choices)

    def stream(self, body: dict, *, chat: bool = False) -> Iterator[tuple[str, dict]]:
        """Yields (text delta, raw chunk); the last chunks carry finish_reason / usage."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        with self._post(path, {**body, "stream": True}) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"server error: {chunk['error']}")
                delta = ""
                for choice in chunk.get("choices", []):
                    delta += (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")
                yield delta, chunk


class GrpcClient:
    def __init__(self, target: str = "127.0.0.1:9000", application: str | None = None, timeout_s: float = 300.0) -> None:
        import grpc

        from router.proto import flashprefill_pb2_grpc

        self._channel = grpc.insecure_channel(target)
        self.stub = flashprefill_pb2_grpc.FlashPrefillStub(self._channel)
        self.metadata = (("application", application),) if application else ()
        self.timeout_s = timeout_s

    def model(self) -> str:
        """The served model id (the ListModels call)."""
        from router.proto import flashprefill_pb2 as pb

        resp = self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata, timeout=self.timeout_s)
        if not resp.models:
            raise RuntimeError("the server lists no model")
        return resp.models[0].id

    def request(self, **fields: Any):
        from router.proto import flashprefill_pb2 as pb

        messages = fields.pop("messages", None)
        msg = pb.GenerateRequest(**fields)
        for m in messages or []:
            msg.messages.add(role=m["role"], content=m["content"])
        return msg

    def generate(self, **fields: Any) -> ClientResult:
        resp = self.stub.Generate(self.request(**fields), metadata=self.metadata, timeout=self.timeout_s)
        return ClientResult(resp.text, list(resp.token_ids), resp.finish_reason,
                            _msg_dict(resp.usage), _msg_dict(resp.timing), _msg_dict(resp.routing),
                            [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                              "finish_reason": c.finish_reason} for c in resp.choices])

    def stream(self, **fields: Any):
        return self.stub.GenerateStream(self.request(**fields), metadata=self.metadata, timeout=self.timeout_s)

    def close(self) -> None:
        self._channel.close()


def _msg_dict(msg: Any) -> dict:
    """The fields set in a protobuf message as plain Python values, nested messages (and lists
    of them) as dicts too; numbers stay numbers (json_format.MessageToDict writes int64 as text)."""
    out: dict[str, Any] = {}
    for field, value in msg.ListFields():
        is_message = field.type == field.TYPE_MESSAGE
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _msg_dict(v) if entry.type == entry.TYPE_MESSAGE else v for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_msg_dict(v) if is_message else v for v in value]
        else:
            out[field.name] = _msg_dict(value) if is_message else value
    return out


def run_client(args: Any) -> int:
    chat = bool(args.chat)
    fields: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        fields["temperature"] = args.temperature
    if args.seed is not None:
        fields["seed"] = args.seed
    n = getattr(args, "n", None)
    if n is not None:
        fields["n"] = n
    several = (n or 1) > 1  # each choice printed apart: '[i] text'
    try:
        if args.grpc:
            client = GrpcClient(args.grpc_target, args.application)
            model = args.model or client.model()
            prompt = {"messages": [{"role": "user", "content": args.prompt}]} if chat else {"prompt": args.prompt}
            if args.stream:
                last, texts = None, {}
                for msg in client.stream(model=model, **prompt, **fields):
                    if several:  # choices interleave: print each whole at the end
                        texts[msg.index] = texts.get(msg.index, "") + msg.text
                    else:
                        sys.stdout.write(msg.text)
                        sys.stdout.flush()
                    last = msg
                if several:
                    for i in sorted(texts):
                        print(f"[{i}] {texts[i]}")
                else:
                    print()
                if last is not None:
                    print(f"[{last.finish_reason}] usage={_msg_dict(last.usage)} timing={_msg_dict(last.timing)}", file=sys.stderr)
            else:
                res = client.generate(model=model, **prompt, **fields)
                if several:
                    for c in res.choices:
                        print(f"[{c['index']}] {c['text']}")
                else:
                    print(res.text)
                print(f"[{res.finish_reason}] usage={res.usage} timing={res.timing}", file=sys.stderr)
            client.close()
            return 0
        client = HttpClient(args.url)
        model = args.model or client.model()
        body = {"model": model, **fields}
        body.update({"messages": [{"role": "user", "content": args.prompt}]} if chat else {"prompt": args.prompt})
        if args.stream:
            body["stream_options"] = {"include_usage": True}
            finish = usage = timing = None
            texts: dict[int, str] = {}
            for delta, chunk in client.stream(body, chat=chat):
                if not several:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                    piece = (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")
                    texts[choice["index"]] = texts.get(choice["index"], "") + piece
                usage = chunk.get("usage") or usage
                timing = chunk.get("timing") or timing
            if several:
                for i in sorted(texts):
                    print(f"[{i}] {texts[i]}")
            else:
                print()
            print(f"[{finish}] usage={usage} timing={timing}", file=sys.stderr)
        else:
            res = client.generate(body, chat=chat)
            if several:
                for c in res.choices:
                    print(f"[{c['index']}] {c['text']}")
            else:
                print(res.text)
            print(f"[{res.finish_reason}] usage={res.usage} timing={res.timing}", file=sys.stderr)
        return 0
    except urllib.error.HTTPError as exc:
        print(f"HTTP {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"cannot reach {args.url}: {exc.reason} (is `python -m router serve` running?)", file=sys.stderr)
        return 1
    except Exception as exc:  # grpc.RpcError and friends
        code = getattr(exc, "code", lambda: None)()
        details = getattr(exc, "details", lambda: str(exc))()
        print(f"error: {code}: {details}", file=sys.stderr)
        return 1
