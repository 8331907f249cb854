"""GGUF reading: tiny GGUF files written here from tiny random Hugging Face models (the way
llama.cpp's converter writes them) load back to the Hugging Face config and weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from pagedserve.config import ModelConfig
from pagedserve.model.checkpoint import iterate_weights
from pagedserve.model.gguf_config import gguf_to_hf_config
from pagedserve.model.gguf_file import GGUFFile, StringArray
from pagedserve.model.loader import load_model
from pagedserve.model.resolve import CheckpointError, resolve_model

# llama.cpp tensor names, written out independently of the loader's table.
GGUF_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_BLOCK_NAMES[module]}.{kind}"


def llamacpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (q: n_head, k: n_head_kv)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_tensor(arch: str, name: str, value: np.ndarray, config) -> np.ndarray:
    """The tensor as llama.cpp's converter stores it (before quantization)."""
    if arch == "llama" and ".q_proj." in name:
        return llamacpp_permute(value, config.num_attention_heads)
    if arch == "llama" and ".k_proj." in name:
        return llamacpp_permute(value, config.num_key_value_heads)
    return value


def gguf_writer(path: Path, arch: str, config) -> gguf.GGUFWriter:
    """A GGUF writer holding ``config``'s metadata, as llama.cpp's converter writes it (a
    token list of placeholder names); tensors are added by the caller, then ``finish``."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_token_list([f"tok{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    return writer


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(path: Path, arch: str, state: dict[str, torch.Tensor], config, qtype: QType) -> None:
    """Write ``state`` (HF names) as a GGUF file; 2-D tensors in ``qtype``, 1-D ones in F32."""
    writer = gguf_writer(path, arch, config)
    for name, tensor in state.items():
        value = gguf_tensor(arch, name, tensor.float().numpy(), config)
        tensor_type = qtype if value.ndim == 2 else QType.F32
        data = quantize(value, tensor_type)
        writer.add_tensor(gguf_name(name), data, raw_dtype=tensor_type)
    finish(writer)


def quantize(value: np.ndarray, qtype: QType) -> np.ndarray:
    """``gguf.quants.quantize``; for Q8_1, which it cannot write, blocks of random bytes
    (only ever read back to be refused)."""
    if qtype != QType.Q8_1:
        return gguf.quants.quantize(value, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, row_len = value.shape
    shape = (rows, row_len // block_size * type_size)
    return np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)


def tiny_hf_model(arch: str, tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    config = CONFIGS[arch](**TINY, tie_word_embeddings=tie)
    return AutoModelForCausalLM.from_config(config).eval()


def roundtrip(value: torch.Tensor, qtype: QType) -> torch.Tensor:
    """What a perfect reader returns for ``value`` stored in ``qtype`` (1-D stays F32)."""
    if value.dim() == 1:
        return value.float()
    array = value.float().numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype))


@pytest.mark.parametrize(
    ("arch", "qtype", "tie"),
    [
        ("llama", QType.F32, False),
        ("llama", QType.F16, True),
        ("llama", QType.BF16, False),
        ("llama", QType.Q8_0, True),
        ("llama", QType.Q4_0, False),
        ("llama", QType.Q4_1, False),
        ("qwen2", QType.F32, False),
        ("qwen3", QType.F32, True),
    ],
)
def test_gguf_loads_back_to_hf_weights(tmp_path: Path, arch: str, qtype: QType, tie: bool) -> None:
    hf_model = tiny_hf_model(arch, tie)
    state = {k: v for k, v in hf_model.state_dict().items() if not (tie and k == "lm_head.weight")}
    write_gguf(tmp_path / "tiny.gguf", arch, state, hf_model.config, qtype)

    resolved = resolve_model(str(tmp_path / "tiny.gguf"))
    assert resolved.format == "gguf" and resolved.gguf_file == tmp_path / "tiny.gguf"
    loaded = dict(iterate_weights(resolved))
    assert set(loaded) == set(state)
    for name, value in state.items():
        got = loaded[name]
        assert got.shape == value.shape, name
        # Exact against what the storage type can represent: catches any layout slip.
        torch.testing.assert_close(got, roundtrip(value, qtype), rtol=0, atol=0, msg=name)
        if qtype == QType.F32:
            torch.testing.assert_close(got, value, rtol=0, atol=0, msg=name)
        else:
            # 4-bit blocks: error <= half a step of max|w| / 8 per block of 32 (weights ~0.02).
            torch.testing.assert_close(got, value, rtol=0, atol=0.01, msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_config_matches_hf(tmp_path: Path, arch: str) -> None:
    hf_model = tiny_hf_model(arch, tie=True)
    write_gguf(tmp_path / "m.gguf", arch, hf_model.state_dict(), hf_model.config, QType.F32)
    config = gguf_to_hf_config(tmp_path / "m.gguf")
    expected = hf_model.config
    assert type(config) is type(expected)
    assert config.architectures == [type(hf_model).__name__]
    for key in (*TINY.keys() - {"rope_theta", "rms_norm_eps"}, "head_dim"):
        assert getattr(config, key) == getattr(expected, key), key
    assert config.rope_parameters["rope_theta"] == expected.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)  # stored as f32
    # written with lm_head.weight, so "output.weight" is present -> untied
    assert config.tie_word_embeddings is False


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_1])  # the default model's two
def test_gguf_matches_transformers_gguf_reader(tmp_path: Path, qtype: QType) -> None:
    """transformers' own GGUF loader (an independent reader) sees the same weights as ours."""
    hf_model = tiny_hf_model("llama", tie=False)
    write_gguf(tmp_path / "m.gguf", "llama", hf_model.state_dict(), hf_model.config, qtype)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").state_dict()
    ours = dict(iterate_weights(resolve_model(str(tmp_path))))
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name].float(), rtol=0, atol=0, msg=name)


def test_unsupported_gguf_tensor_type_names_file_and_tensor(tmp_path: Path) -> None:
    hf_model = tiny_hf_model("llama", tie=True)
    state = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "q8_1.gguf"
    write_gguf(path, "llama", state, hf_model.config, QType.Q8_1)
    with pytest.raises(CheckpointError) as err:
        load_model(
            ModelConfig(model=str(path), dtype="float32"), torch.device("cpu"), torch.float32
        )
    message = str(err.value)
    assert str(path) in message and "Q8_1" in message and "Q4_K" in message  # names supported
    assert "token_embd.weight" in message and "model.embed_tokens.weight" in message


def test_unsupported_gguf_architecture_names_file(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(path, "phi2")
    writer.add_block_count(1)
    finish(writer)
    with pytest.raises(ValueError, match=r"phi\.gguf.*'phi2' is not supported"):
        resolve_model(str(path))


def _write_metadata_sample(path: Path) -> None:
    """Every GGUF value type, arrays of numbers, strings and arrays, and tensors of 3 types."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.5)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "naïve ☃")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.25, 1.5])
    writer.add_array("t.strs", ["a", "", "ccc"])
    writer.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    for name, qtype in (("a.weight", QType.F32), ("b.weight", QType.Q8_0), ("c.weight", QType.F16)):
        value = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    finish(writer)


def test_gguf_file_reads_what_gguf_reader_reads(tmp_path: Path) -> None:
    path = tmp_path / "sample.gguf"
    _write_metadata_sample(path)
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        expected = theirs.fields[key].contents()
        if key == "t.strs":
            assert ours.metadata[key] == StringArray(3)  # walked, not decoded
        elif key == "t.nested":  # gguf's reader flattens nested arrays; we keep the nesting
            assert ours.metadata[key] == [[1, 2], [3]]
        elif isinstance(expected, float):
            assert ours.metadata[key] == pytest.approx(expected, rel=1e-7), key
        else:
            assert ours.metadata[key] == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.qtype == ref.tensor_type
        assert mine.shape == tuple(reversed([int(d) for d in ref.shape]))
        assert np.array_equal(mine.data, ref.data.reshape(-1).view(np.uint8)), mine.name


def test_gguf_file_errors_name_the_file(tmp_path: Path) -> None:
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(ValueError, match=r"weights\.gguf: not a GGUF file"):
        GGUFFile(not_gguf)
    sample = tmp_path / "sample.gguf"
    _write_metadata_sample(sample)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(sample.read_bytes()[:200])  # cut inside the key/values
    with pytest.raises(ValueError, match=r"truncated\.gguf: not a readable GGUF file"):
        GGUFFile(truncated)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.gguf"):
        GGUFFile(empty)
