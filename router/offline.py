"""Single-process generation: prefill then decode in one process sharing one KV pool (the
offline entry point, beside the service's ingress: it drives both worker engines).

Used by tests and as the oracle for the disaggregated service (same runner, same sampler,
same seeds; only the KV transfer between pools is missing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kernels.config import SparseConfig

from decode_worker.engine import DecodeEngine
from model_executor.loading import LoadedModel, load_model, make_pool
from model_executor.runner import ModelRunner
from model_executor.sampling import SamplingParams
from prefill_worker.engine import PrefillEngine, PrefillRequest


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str


def generate(
    prompts: Sequence[Sequence[int] | str],
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    *,
    model: LoadedModel | None = None,
    sparse_config: SparseConfig | None = None,
    dense_below: int = 1024,
    page_size: int = 64,
    num_pages: int | None = None,
    chunk_size: int | None = None,
    max_batch_tokens: int = 8192,
    max_running: int = 256,
    backend: str = "auto",
    ignore_eos: bool = False,
) -> list[GenerationResult]:
    """Generate for every prompt (token ids, or text when the model has a tokenizer).

    ``model`` defaults to the built-in tiny model. The pool holds every prompt plus its
    ``max_new_tokens`` unless ``num_pages`` says otherwise. Results in prompt order.

    Generation stops at the tokenizer's end-of-text tokens (``tokenizer.stop_token_ids``, e.g.
    SmolLM2's ``<|im_end|>``) besides each request's own ``stop_token_ids``, as the service's
    ingress does; ``ignore_eos=True`` stops only at the request's own (vLLM's ``ignore_eos``).
    """
    loaded = model if model is not None else load_model(None)
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"params: expected one SamplingParams per prompt ({len(prompts)}), got {len(params)}")
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos: expected a bool, got {ignore_eos!r}")
    eos = () if ignore_eos else tuple(getattr(loaded.tokenizer, "stop_token_ids", ()) or ())
    if eos:
        params = [sp if set(eos) <= set(sp.stop_token_ids) else dataclasses.replace(
            sp, stop_token_ids=sp.stop_token_ids + tuple(t for t in eos if t not in sp.stop_token_ids))
            for sp in params]
    ids: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if loaded.tokenizer is None:
                raise ValueError(f"prompts[{i}]: got text but the model has no tokenizer; pass token ids")
            ids.append(loaded.tokenizer.encode(p))
        else:
            ids.append([int(t) for t in p])
    if num_pages is None:
        num_pages = sum(-(-(len(x) + sp.max_new_tokens) // page_size) for x, sp in zip(ids, params)) + 1
    pool = make_pool(loaded, num_pages=num_pages, page_size=page_size)
    runner = ModelRunner(
        loaded.model, pool, sparse_config, dense_below=dense_below, device=pool.k.device, backend=backend
    )
    # the tokenizer compiles structured-output guides (``params.guided``)
    prefill = PrefillEngine(runner, max_batch_tokens=max_batch_tokens, chunk_size=chunk_size, tokenizer=loaded.tokenizer)
    decode = DecodeEngine(runner, max_running=max_running, tokenizer=loaded.tokenizer)
    rids = [f"gen-{i}" for i in range(len(ids))]
    firsts = prefill.prefill([PrefillRequest(r, x, sp) for r, x, sp in zip(rids, ids, params)])
    for res, x, sp in zip(firsts, ids, params):
        decode.add_request(res.request_id, res.kv_len, res.first_token, sp)
    decode.run_until_done()
    out = []
    for rid, x in zip(rids, ids):
        req = decode.pop_finished(rid)
        out.append(GenerationResult(rid, tuple(x), tuple(req.output_ids), req.finish_reason.value))
    return out
