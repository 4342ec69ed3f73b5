"""A Hugging Face `config.json`, as a user has it on disk, read as a `sim.layers.LayerStack`.

Pure: it takes the parsed JSON (a dict) and reads no file (`kvfrag.config` reads it). What
each layer keeps is decided the way transformers and vLLM decide it:

- `layer_types` (gpt-oss, newer Gemma, Llama 4 and Qwen3-Next configs): `full_attention`,
  `sliding_attention` (window `sliding_window`), `chunked_attention` (`attention_chunk_size`),
  `linear_attention` (a gated delta net's state, `linear_*` fields).
- Without it: `sliding_window_pattern` (Gemma 3, Cohere 2: layer i is full when (i + 1) is a
  multiple of it; 6 for a Gemma 3 config that omits it, as transformers defaults), Gemma 2's
  alternation (even layers sliding), Llama 4's `no_rope_layers` (RoPE layers are chunked when
  `attention_chunk_size` is set; by default every 4th layer is full), Jamba's
  `attn_layer_period` / `attn_layer_offset` (the rest Mamba 1),
  Qwen3-Next's `full_attention_interval` (the rest gated delta nets), or `sliding_window` on
  every layer (Mistral 7B v0.1) unless `use_sliding_window` is false.
- `kv_lora_rank` (DeepSeek V2/V3, Kimi K2): every layer MLA, latent + `qk_rope_head_dim`.

Heads: `num_key_value_heads` (default `num_attention_heads`), `head_dim` (default
hidden_size / num_attention_heads). KV dtype: `torch_dtype` or `dtype` (bf16 when absent, as
vLLM serves an fp32 checkpoint). A multimodal config's `text_config` is the model read; fields
it lacks (the dtype) are taken from the outer config. Every figure is bounded as a scenario's
are (`workloads.spec`). A field that cannot be interpreted raises `HfConfigError`, whose
message is `field: problem` (the caller names the file).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvfrag.sim.architecture import Architecture
from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    Layer,
    LayerStack,
    MambaState,
    SlidingWindow,
)
from kvfrag.workloads.spec import (
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_TOKENS,
    MAX_VOCAB,
    check_number,
    show,
)

#: Bytes per element of the dtypes a config names (`torch_dtype` / `dtype`).
DTYPE_BYTES = {
    "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float32": 4, "float": 4, "fp32": 4, "float64": 8, "double": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
}
#: Largest state dimension read (d_state, expand x hidden, heads x head size): far above any
#: published model's.
MAX_STATE_DIM = 1_048_576
#: Dense, full-attention model types whose matrices the roofline's `Architecture` describes
#: (SwiGLU MLP, untied head unless said otherwise; Qwen 2 with QKV biases).
DENSE_TYPES = {"llama": False, "mistral": False, "qwen2": True, "qwen3": False}
#: Keys that mark a mixture of experts (no `Architecture`: see `architecture`).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


class HfConfigError(ValueError):
    """A config.json field kvfrag cannot interpret; the message is `field: problem`."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field, self.problem = field, problem


class _Reader:
    """Typed, bounded reads of one config (its text part, with the outer one as fallback)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        if not isinstance(config, Mapping):
            raise HfConfigError("", "a config.json is a JSON object of fields (num_hidden_layers, "
                                f"num_key_value_heads, ...), not {show(config)}")
        text = config.get("text_config")
        if text is not None and not isinstance(text, Mapping):
            raise HfConfigError("text_config", f"must be an object, not {show(text)}")
        self.outer, self.text = config, text if text is not None else config
        self.prefix = "text_config." if text is not None else ""

    def has(self, key: str) -> bool:
        return self.text.get(key) is not None

    def raw(self, key: str) -> Any:
        return self.text.get(key)

    def name(self, key: str) -> str:
        return self.prefix + key

    def whole(self, key: str, low: int, high: int, default: int | None = None) -> int:
        value = self.text.get(key)
        if value is None:
            if default is not None:
                return default
            raise HfConfigError(self.name(key), "missing; kvfrag needs it to lay out the layers")
        try:
            return int(check_number(value, low, high, whole=True))
        except ValueError as exc:
            raise HfConfigError(self.name(key), str(exc)) from None

    def dtype_bytes(self, keys: tuple[str, ...] = ("torch_dtype", "dtype"),
                    default: int | None = 2) -> int | None:
        for where, config in ((self.prefix, self.text), ("", self.outer)):
            for key in keys:
                value = config.get(key)
                if value is None:
                    continue
                if isinstance(value, str) and value.removeprefix("torch.") in DTYPE_BYTES:
                    return DTYPE_BYTES[value.removeprefix("torch.")]
                raise HfConfigError(where + key, f"unknown dtype {show(value)} (known: "
                                    f"{', '.join(sorted(DTYPE_BYTES))})")
        return default


def parse(config: Mapping[str, Any], name: str | None = None) -> LayerStack:
    """The model a config.json describes, as its layers in order. `name`: the stack's name
    (default: the config's `_name_or_path` or `model_type`)."""
    r = _Reader(config)
    n = r.whole("num_hidden_layers", 1, MAX_LAYERS)
    dtype = r.dtype_bytes() or 2
    label = name or _label(r)
    if r.has("kv_lora_rank"):
        latent = r.whole("kv_lora_rank", 1, MAX_HEAD_DIM)
        rope = r.whole("qk_rope_head_dim", 0, MAX_HEAD_DIM, default=0)
        return LayerStack(label, tuple(MLA(latent, rope, dtype) for _ in range(n)))
    kinds = _kinds(r, n)
    make = _makers(r, dtype, set(kinds))
    return LayerStack(label, tuple(make[kind]() for kind in kinds))


def _label(r: _Reader) -> str:
    for key in ("_name_or_path", "model_type"):
        for config in (r.outer, r.text):
            value = config.get(key)
            if isinstance(value, str) and value.strip():
                return value.strip()[:100]
    return "hf-config"


#: The layer kinds of `layer_types` (transformers' names) and kvfrag's.
LAYER_TYPES = {
    "full_attention": "full", "sliding_attention": "sliding_window",
    "chunked_attention": "chunked_local", "linear_attention": "gated_delta_net",
}


def _kinds(r: _Reader, n: int) -> list[str]:
    """Each layer's kind, in order."""
    model_type = r.raw("model_type") or r.outer.get("model_type")
    if r.has("layer_types"):
        types = r.raw("layer_types")
        if not isinstance(types, list):
            raise HfConfigError(r.name("layer_types"), f"must be a list, not {show(types)}")
        if len(types) != n:
            raise HfConfigError(r.name("layer_types"), f"names {len(types)} layers but "
                                f"num_hidden_layers is {n}")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise HfConfigError(f"{r.name('layer_types')}[{i}]", f"unknown layer type "
                                    f"{show(t)} (kvfrag reads {', '.join(LAYER_TYPES)})")
        return [LAYER_TYPES[t] for t in types]
    for key in ("sliding_window_pattern", "_sliding_window_pattern", ""):
        gemma3 = not key and model_type in ("gemma3", "gemma3_text")
        if (gemma3 or r.has(key)) and r.has("sliding_window"):
            p = 6 if gemma3 else r.whole(key, 1, MAX_LAYERS)  # (transformers' Gemma 3 default)
            return ["full" if (i + 1) % p == 0 else "sliding_window" for i in range(n)]
    if model_type == "gemma2" and r.has("sliding_window"):
        return ["sliding_window" if i % 2 == 0 else "full" for i in range(n)]
    if r.has("attention_chunk_size") or r.has("no_rope_layers"):
        return _llama4(r, n)
    if r.has("attn_layer_period") or model_type == "jamba":
        period = r.whole("attn_layer_period", 1, MAX_LAYERS, default=8)
        offset = r.whole("attn_layer_offset", 0, MAX_LAYERS, default=4)
        if offset >= period:
            raise HfConfigError(r.name("attn_layer_offset"), f"must be below attn_layer_period "
                                f"({period}), not {offset}")
        return ["full" if i % period == offset else "mamba1" for i in range(n)]
    if r.has("full_attention_interval"):
        k = r.whole("full_attention_interval", 1, MAX_LAYERS)
        return ["full" if (i + 1) % k == 0 else "gated_delta_net" for i in range(n)]
    if r.has("sliding_window") and r.raw("use_sliding_window") is not False:
        return ["sliding_window"] * n
    return ["full"] * n


def _llama4(r: _Reader, n: int) -> list[str]:
    """Llama 4: a RoPE layer (`no_rope_layers[i]` 1) is chunked when attention_chunk_size is
    set; a NoPE layer (0) is full (vLLM's `Llama4Attention`)."""
    flags = r.raw("no_rope_layers")
    if flags in (None, []):
        every = r.whole("no_rope_layer_interval", 1, MAX_LAYERS, default=4)
        flags = [int((i + 1) % every != 0) for i in range(n)]
    elif not isinstance(flags, list) or len(flags) != n:
        count = f"{len(flags)} layers" if isinstance(flags, list) else show(flags)
        raise HfConfigError(r.name("no_rope_layers"), f"must list one 0 or 1 per layer "
                            f"({n}), not {count}")
    for i, flag in enumerate(flags):
        if flag not in (0, 1) or isinstance(flag, bool):
            raise HfConfigError(f"{r.name('no_rope_layers')}[{i}]",
                                f"must be 0 or 1, not {show(flag)}")
    chunked = r.has("attention_chunk_size")
    return ["chunked_local" if flag and chunked else "full" for flag in flags]


def _makers(r: _Reader, dtype: int, kinds: set[str]) -> dict[str, Callable[[], Layer]]:
    """One constructor per layer kind present, its figures read (and checked) once."""
    make: dict[str, Callable[[], Layer]] = {}
    if kinds & {"full", "sliding_window", "chunked_local"}:
        heads = r.whole("num_attention_heads", 1, MAX_HEADS)
        kv = r.whole("num_key_value_heads", 1, MAX_HEADS, default=heads)
        if r.has("head_dim"):
            hd = r.whole("head_dim", 1, MAX_HEAD_DIM)
        else:
            hidden = r.whole("hidden_size", 1, MAX_HIDDEN)
            if hidden % heads:
                raise HfConfigError(r.name("head_dim"), f"missing, and hidden_size ({hidden}) "
                                    f"is not a multiple of num_attention_heads ({heads})")
            hd = hidden // heads
        full = FullAttention(kv, hd, dtype)
        make["full"] = lambda: full
        if "sliding_window" in kinds:
            window = SlidingWindow(kv, hd, dtype, r.whole("sliding_window", 1, MAX_TOKENS))
            make["sliding_window"] = lambda: window
        if "chunked_local" in kinds:
            chunk = ChunkedLocal(kv, hd, dtype, r.whole("attention_chunk_size", 1, MAX_TOKENS))
            make["chunked_local"] = lambda: chunk
    ssm = r.dtype_bytes(("mamba_ssm_dtype", "mamba_ssm_cache_dtype"), default=None)
    if "mamba1" in kinds:
        hidden = r.whole("hidden_size", 1, MAX_HIDDEN)
        expand = r.whole("mamba_expand", 1, MAX_STATE_DIM, default=2)
        state = MambaState.mamba1(
            _state_dim(r, "mamba_expand", expand * hidden),
            r.whole("mamba_d_state", 1, MAX_STATE_DIM, default=16),
            r.whole("mamba_d_conv", 2, MAX_STATE_DIM, default=4), dtype, ssm,
        )
        make["mamba1"] = lambda: state
    if "gated_delta_net" in kinds:
        gdn = MambaState.gated_delta_net(
            r.whole("linear_num_key_heads", 1, MAX_HEADS),
            r.whole("linear_num_value_heads", 1, MAX_HEADS),
            r.whole("linear_key_head_dim", 1, MAX_HEAD_DIM),
            r.whole("linear_value_head_dim", 1, MAX_HEAD_DIM),
            r.whole("linear_conv_kernel_dim", 2, MAX_STATE_DIM), dtype, ssm,
        )
        make["gated_delta_net"] = lambda: gdn
    return make


def _state_dim(r: _Reader, key: str, value: int) -> int:
    if value > MAX_STATE_DIM:
        raise HfConfigError(r.name(key), f"gives a state {value:,} wide; at most "
                            f"{MAX_STATE_DIM:,}")
    return value


def architecture(config: Mapping[str, Any], name: str) -> Architecture | None:
    """The matrices the roofline times, where the config is a dense, full-attention model of a
    known type (Llama, Mistral, Qwen 2/3); else None. A mixture of experts is left out on
    purpose: its weights read per step and FLOPs per token depend on the experts the batch
    routes to, which one `intermediate` cannot say; a sliding or chunked model's attention
    reads only its window, which the roofline would overstate."""
    r = _Reader(config)
    model_type = r.raw("model_type")
    if model_type not in DENSE_TYPES or any(r.has(k) for k in MOE_KEYS):
        return None
    stack = parse(config, name)
    if stack.hybrid or not all(isinstance(a, FullAttention) for a in stack.layers):
        return None
    first = stack.layers[0]
    assert isinstance(first, FullAttention)
    return Architecture(
        name, r.whole("hidden_size", 1, MAX_HIDDEN),
        r.whole("intermediate_size", 1, MAX_INTERMEDIATE), len(stack.layers),
        r.whole("num_attention_heads", 1, MAX_HEADS), first.kv_heads, first.head_dim,
        r.whole("vocab_size", 1, MAX_VOCAB), gated_mlp=True,
        tied_embeddings=r.raw("tie_word_embeddings") is True,
        qkv_bias=DENSE_TYPES[model_type],
    )


#: vLLM 0.33's keys for a model's own maximum length, the smallest present winning
#: (`ModelArchConfigConvertorBase.derive_max_model_len_and_key`); `model_max_length`, when
#: present, wins over the others (Command-R).
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
               "model_max_length", "max_target_positions", "max_sequence_length",
               "max_seq_length", "seq_len")
#: RoPE types whose `factor` vLLM does not apply again to the length: YaRN and its kin leave
#: max_position_embeddings already scaled (`_get_and_verify_max_len`, config/model.py).
SCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn",
                     "deepseek_llama_scaling")


def context_length(config: Mapping[str, Any]) -> int | None:
    """The max_model_len vLLM 0.33 derives from a config.json when none is given: the
    smallest of `LENGTH_KEYS` in the (text) config, times the RoPE scaling `factor` unless its
    type already scaled it (and never for Gemma 3, whose length is already scaled). None when
    the config names no length (vLLM would then assume 2,048 with a warning; kvfrag asks for
    max_model_len instead). vLLM also caps it by the tokenizer's `model_max_length`, which a
    config.json does not hold."""
    r = _Reader(config)
    found: dict[str, int] = {}
    for key in LENGTH_KEYS:
        if r.has(key):
            found[key] = r.whole(key, 1, MAX_TOKENS)
    if not found:
        return None
    length = float(found.get("model_max_length", min(found.values())))
    if "gemma3" not in str(r.outer.get("model_type", "")):
        factor = 1.0
        for params in _rope_parameters(r.outer):
            kind = params.get("rope_type", params.get("type", "default"))
            if kind not in SCALED_ROPE_TYPES and params.get("factor") is not None:
                try:
                    factor = check_number(params["factor"], 1e-6, 1e6)
                except ValueError as exc:
                    raise HfConfigError("rope_scaling.factor", str(exc)) from None
        length *= factor
    return int(length)


def _rope_parameters(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The config's RoPE parameters (`rope_parameters`, or the older `rope_scaling`), one
    mapping per layer type where they are nested (vLLM's `iter_rope_parameters`)."""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(params, Mapping) or not params:
        return []
    nested = [v for v in params.values() if isinstance(v, Mapping)]
    if nested and len(nested) == len(params):
        return [v for v in nested if v]
    return [params]


#: Every field `parse`, `architecture` and `context_length` read: what a scenario keeps of a
#: config.json.
READ_KEYS = frozenset({*LENGTH_KEYS, "rope_parameters", "rope_scaling",
    "_name_or_path", "model_type", "torch_dtype", "dtype", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "intermediate_size", "vocab_size", "tie_word_embeddings", "layer_types", "sliding_window",
    "sliding_window_pattern", "_sliding_window_pattern", "use_sliding_window",
    "attention_chunk_size", "no_rope_layers", "no_rope_layer_interval", "kv_lora_rank",
    "qk_rope_head_dim", "attn_layer_period", "attn_layer_offset", "mamba_expand",
    "mamba_d_state", "mamba_d_conv", "full_attention_interval", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "mamba_ssm_dtype", "mamba_ssm_cache_dtype", *MOE_KEYS,
    # (MTP layers: the draft's KV under speculative decoding, sim/speculative_spec.py)
    "num_nextn_predict_layers", "mtp_num_hidden_layers",
})


def relevant(config: Any) -> Any:
    """The config cut to `READ_KEYS` (and its text_config's): what a resolved scenario keeps.
    Anything that is not a JSON object is returned as is, for `parse` to refuse."""
    if not isinstance(config, Mapping):
        return config
    out = {k: v for k, v in config.items() if k in READ_KEYS}
    text = config.get("text_config")
    if text is not None:
        out["text_config"] = relevant(text)
    return out
