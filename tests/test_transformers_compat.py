"""Our top-level package is named ``kernels``, like the optional PyPI package transformers
integrates with (``transformers.integrations.hub_kernels``). transformers must never take
ours for theirs: ``is_kernels_available()`` stays False and models build and run.

Each check runs in a fresh interpreter whose ``sys.path`` puts this repository first (as a
checkout or an editable install does), because transformers caches the answer per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_PROBE = textwrap.dedent(
    """
    import importlib.util, sys
    import torch
    import transformers
    from transformers.utils.import_utils import is_kernels_available
    import kernels
    assert kernels.__file__.startswith({repo!r}), kernels.__file__  # ours is the one importable
    assert is_kernels_available() is False, "transformers takes our kernels for the hub package"
    import transformers.integrations.hub_kernels as hk  # imports cleanly
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        eager = model(ids).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(ids).logits
    assert torch.allclose(eager, sdpa, atol=1e-5)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 16)
    # our attention too, registered alongside
    from model_executor.attention import register_attention
    name = register_attention()
    model.set_attn_implementation(name)
    assert model.config._attn_implementation == name
    print("OK", transformers.__version__)
    """
)


def _run(extra_path: list[str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    paths = [str(REPO), *(extra_path or []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("USE_HUB_KERNELS", None)
    return subprocess.run(
        [sys.executable, "-c", _PROBE.format(repo=str(REPO))],
        cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300,
    )


def test_transformers_ignores_our_kernels_package():
    proc = _run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith("OK")


def test_transformers_ignores_our_kernels_when_installed_with_metadata(tmp_path):
    """As after ``pip install .``: a dist-info whose top_level lists ``kernels`` maps the import
    name to our distribution, so transformers reads *our* version. It must fall outside the
    hub package's supported range (see the report: renaming the package is the robust fix)."""
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    info = tmp_path / f"flashprefill_serve-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashprefill-serve\nVersion: {version}\n")
    (info / "top_level.txt").write_text("kernels\nmodel_executor\n")
    (info / "RECORD").write_text("")
    proc = _run([str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("kernels_version", ["0.18.5"])
def test_kernels_name_clash_hazard_is_real(tmp_path, kernels_version):
    """Documents the hazard: if our distribution's version ever fell in the hub package's
    range, transformers would import our ``kernels`` as theirs and break. Guarded by the
    project version check above; fixed for good by renaming the package."""
    info = tmp_path / f"flashprefill_serve-{kernels_version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: flashprefill-serve\nVersion: {kernels_version}\n"
    )
    (info / "top_level.txt").write_text("kernels\n")
    (info / "RECORD").write_text("")
    proc = _run([str(tmp_path)])
    if proc.returncode == 0:
        pytest.skip("this transformers version does not map import names to distributions")
    assert "kernels" in proc.stderr
