"""The two forms of a scenario's `model` that describe its layers: written out in YAML, or a
Hugging Face config.json. (A preset is a plain name; a full-attention model written out as
`layers: 32, kv_heads: 8, head_dim: 128` is `sim.scenario_parts.ModelSpec`.)

Layered, one period of the pattern in order, repeated::

    model:
      name: gemma-like
      kv_heads: 16              # defaults for every attention group
      head_dim: 128
      layers:
        - {type: sliding_window, count: 5, window: 1024}
        - {type: full, count: 1}
      num_layers: 62            # or repeat: 10; the pattern is repeated (cut) to this many

Types: `full`, `sliding_window` (window), `chunked_local` (chunk), `mla` (latent, rope) and
`mamba` (state_bytes: a size per layer per request). A group's kv_heads / head_dim override
the model's. Given both, `repeat` and `num_layers` must agree.

From a config.json: `model: {hf_config: path/to/config.json}` (relative to the scenario file;
`name` optional). `kvfrag.config` reads the file and puts `{path, config}` here, the config
cut to the fields `sim.hf_config` reads (the form a resolved copy keeps); this module only
interprets it.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from kvfrag.sim import hf_config
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
from kvfrag.sim.units import MAX_SIZE, check_size, excerpt, format_size, parse_size
from kvfrag.workloads.spec import (
    MAX_DTYPE_BYTES,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_TOKENS,
    FieldError,
)
from kvfrag.workloads.spec import whole as _whole
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Layer types of the layered form, and the fields each takes besides count.
LAYER_FIELDS = {
    "full": ("kv_heads", "head_dim"),
    "sliding_window": ("kv_heads", "head_dim", "window"),
    "chunked_local": ("kv_heads", "head_dim", "chunk"),
    "mla": ("latent", "rope"),
    "mamba": ("state_bytes",),
}
_REQUIRED = {"sliding_window": "window", "chunked_local": "chunk", "mla": "latent",
             "mamba": "state_bytes"}


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LayerGroup(_Frozen):
    """`count` consecutive layers of one type."""

    type: str
    count: _whole(1, MAX_LAYERS) = 1
    kv_heads: _whole(1, MAX_HEADS) | None = None
    head_dim: _whole(1, MAX_HEAD_DIM) | None = None
    window: _whole(1, MAX_TOKENS) | None = None  # tokens a sliding layer keeps
    chunk: _whole(1, MAX_TOKENS) | None = None  # tokens of a chunked-local chunk
    latent: _whole(1, MAX_HEAD_DIM) | None = None  # MLA kv_lora_rank
    rope: _whole(0, MAX_HEAD_DIM) | None = None  # MLA qk_rope_head_dim
    state_bytes: int | str | None = None  # a Mamba layer's state per request (a size)

    @field_validator("type")
    @classmethod
    def _type(cls, value: str) -> str:
        if value not in LAYER_FIELDS:
            raise ValueError(f"unknown layer type {excerpt(value)} "
                             f"(valid: {', '.join(LAYER_FIELDS)})")
        return value

    @field_validator("state_bytes", mode="before")
    @classmethod
    def _state(cls, value: Any) -> Any:
        if value is None:
            return None
        span = f"1 B to {format_size(MAX_SIZE)}"
        try:
            size = check_size(parse_size(value), "state_bytes")
        except ValueError as exc:
            if "at most" in str(exc):
                raise
            raise ValueError(f"state_bytes must be a size from {span} (e.g. 300KiB), "
                             f"not {excerpt(value)}") from None
        if size < 1:
            raise ValueError(f"state_bytes must be a size from {span}, not 0 (a Mamba layer "
                             "keeps a state)")
        return size

    @model_validator(mode="after")
    def _fields(self) -> LayerGroup:
        valid = LAYER_FIELDS[self.type]
        for name in ("kv_heads", "head_dim", "window", "chunk", "latent", "rope",
                     "state_bytes"):
            if getattr(self, name) is not None and name not in valid:
                raise ValueError(f"a {self.type} layer has no {name} (it takes: "
                                 f"{', '.join(('count', *valid))})")
        need = _REQUIRED.get(self.type)
        if need is not None and getattr(self, need) is None:
            raise ValueError(f"a {self.type} layer needs {need}")
        return self

    def layer(self, kv_heads: int | None, head_dim: int | None, dtype: int) -> Layer:
        if self.type == "mla":
            return MLA(int(self.latent or 0), self.rope or 0, dtype)
        if self.type == "mamba":
            return MambaState(int(self.state_bytes or 0), "mamba")
        kv, hd = self.kv_heads or kv_heads, self.head_dim or head_dim
        if kv is None or hd is None:
            missing = "kv_heads" if kv is None else "head_dim"
            raise ValueError(f"a {self.type} layer needs {missing} (on the group or the model)")
        if self.type == "sliding_window":
            return SlidingWindow(kv, hd, dtype, int(self.window or 0))
        if self.type == "chunked_local":
            return ChunkedLocal(kv, hd, dtype, int(self.chunk or 0))
        return FullAttention(kv, hd, dtype)


class LayeredModelSpec(_Frozen):
    """A model written out as groups of typed layers (see the module's docstring)."""

    name: str = "custom"
    layers: list[LayerGroup] = Field(min_length=1)
    repeat: _whole(1, MAX_LAYERS) | None = None
    num_layers: _whole(1, MAX_LAYERS) | None = None
    kv_heads: _whole(1, MAX_HEADS) | None = None
    head_dim: _whole(1, MAX_HEAD_DIM) | None = None
    dtype_bytes: _whole(1, MAX_DTYPE_BYTES) = 2

    @model_validator(mode="after")
    def _count(self) -> LayeredModelSpec:
        period = sum(g.count for g in self.layers)
        total = self._total(period)
        if self.repeat is not None and self.num_layers is not None and total != (
            period * self.repeat
        ):
            raise ValueError(f"num_layers ({self.num_layers}) does not match the pattern: "
                             f"{period} layer(s) x repeat {self.repeat} = {period * self.repeat}")
        if total > MAX_LAYERS:
            raise ValueError(f"the pattern gives {total:,} layers; a model has at most "
                             f"{MAX_LAYERS:,}")
        self.stack()  # (a group missing its heads is said now, at `model`)
        return self

    def _total(self, period: int) -> int:
        if self.num_layers is not None:
            return self.num_layers
        return period * (self.repeat or 1)

    def stack(self) -> LayerStack:
        period = [g.layer(self.kv_heads, self.head_dim, self.dtype_bytes)
                  for g in self.layers for _ in range(g.count)]
        total = self._total(len(period))
        return LayerStack(self.name, tuple(period[i % len(period)] for i in range(total)))


class HfConfigRef(_Frozen):
    """A config.json as `kvfrag.config` read it: its path, and its fields kvfrag reads."""

    path: str
    config: Any


class HfModelSpec(_Frozen):
    """`model: {hf_config: PATH}`: the layers a Hugging Face config.json describes."""

    name: str | None = None
    hf_config: str | HfConfigRef

    @model_validator(mode="after")
    def _read(self) -> HfModelSpec:
        if isinstance(self.hf_config, str):
            raise FieldError(("hf_config",), f"{excerpt(self.hf_config)} was not read (kvfrag "
                             "reads the file when it loads the scenario)")
        try:
            self.stack()
        except ValueError as exc:
            raise FieldError(("hf_config",), f"{self.hf_config.path}: {exc}") from None
        return self

    @property
    def label(self) -> str:
        """The model's name: given, else the config's folder (models/NAME/config.json) or
        file stem."""
        if self.name:
            return self.name
        path = PurePath(self.hf_config.path if isinstance(self.hf_config, HfConfigRef) else
                        self.hf_config)
        return (path.parent.name if path.name == "config.json" else path.stem) or "hf-config"

    def stack(self) -> LayerStack:
        assert isinstance(self.hf_config, HfConfigRef)
        return hf_config.parse(self.hf_config.config, self.label)

    def architecture(self) -> Architecture | None:
        assert isinstance(self.hf_config, HfConfigRef)
        return hf_config.architecture(self.hf_config.config, self.label)
