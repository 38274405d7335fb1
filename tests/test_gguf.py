"""model_executor/gguf.py's shared reader: within ``one_reader_per_file`` a GGUF file is parsed
once however many times transformers opens it; outside, gguf's own reader is back. The whole
conversion of the built-in model is covered by tests/test_real_model.py."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from model_executor.gguf import one_reader_per_file  # noqa: E402


def write_gguf(path, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((4, 8)).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.seed", seed)
    w.add_tensor("w", weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weight


def test_one_reader_per_file_inside_and_gguf_own_reader_after(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    wa, wb = write_gguf(a, 3), write_gguf(b, 4)
    original = gguf.GGUFReader
    with one_reader_per_file():
        first = gguf.GGUFReader(a)
        assert gguf.GGUFReader(str(a)) is first and gguf.GGUFReader(tmp_path / "." / "a.gguf") is first
        other = gguf.GGUFReader(b)
        assert other is not first
        assert first.fields["test.seed"].contents() == 3 and other.fields["test.seed"].contents() == 4
        (ta,), (tb,) = first.tensors, other.tensors
        np.testing.assert_array_equal(np.asarray(ta.data).reshape(wa.shape), wa)
        np.testing.assert_array_equal(np.asarray(tb.data).reshape(wb.shape), wb)
        assert gguf.GGUFReader(a, "r+") is not gguf.GGUFReader(a, "r+")  # writable maps are not shared
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(a) is not gguf.GGUFReader(a)


def test_gguf_own_reader_is_back_after_an_error(tmp_path):
    original = gguf.GGUFReader
    with pytest.raises(RuntimeError, match="boom"), one_reader_per_file():
        assert gguf.GGUFReader is not original
        raise RuntimeError("boom")
    assert gguf.GGUFReader is original


def test_a_gguf_file_of_no_registered_family_is_refused_before_conversion(tmp_path):
    """general.architecture is checked against the registry's GGUF names (model_executor.models)
    before transformers reads the file."""
    from model_executor.gguf import convert_gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("w", np.zeros((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"^model: gpt2.gguf: general.architecture: expected one of "
                                         r"\('llama', 'qwen2', 'qwen3'\), got 'gpt2'"):
        convert_gguf(path, tmp_path / "out")
