"""`engine.speculative` as a scenario writes it, and what it changes outside the engine.

The keys (method, num_tokens, acceptance, seed, draft_layers) resolve into sim/speculative.py's
`Speculative`: `acceptance` is a rate (each draft accepted with probability p until the first
rejection), `{distribution: [[accepted, weight], ...]}`, or `column` (the request table's
`accepted_drafts`, neither rate nor distribution).

A draft with KV layers of its own holds memory too. vLLM's planner puts the draft's KV layers
in the target's group, so every block holds them as well: the pool has budget // (all layers'
page bytes) blocks (tests/oracle/test_spec_driver.py,
test_draft_kv_layers_share_the_targets_blocks). kvfrag counts `draft_layers` layers of the
target's layer shape in the bytes per token its allocators see (`draft_geometry`,
`draft_stack`). Defaults: EAGLE one layer, MTP the model's MTP layers (config.json's
`num_nextn_predict_layers`, 1 where it names none), n-gram none; a draft model's must be given,
as `draft_layers` (in the target's shape) or as `draft_model`, a model preset whose layers are
counted in their own shape (vLLM's planner adds each layer's page bytes, whatever its shape:
test_draft_kv_layers_share_the_targets_blocks has a draft of 4 KV heads) and whose weights a
budget derived from the GPU's memory leaves out too (vLLM loads both models before it measures
what is left; the draft's own activations are not counted: the target's dummy pass is the
larger).

What the engine does not model with speculative decoding is refused here (`refusal`) or, for
what only the built request table shows, by `check_workload`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pandas as pd
from kvfrag.sim.architecture import PRESETS as ARCHITECTURES
from kvfrag.sim.architecture import Architecture
from kvfrag.sim.geometry import PRESETS as GEOMETRIES
from kvfrag.sim.geometry import KVGeometry
from kvfrag.sim.layers import MLA, FullAttention, LayerStack, MambaState
from kvfrag.sim.presets import nearest
from kvfrag.sim.speculative import METHODS, Speculative
from kvfrag.sim.units import excerpt
from kvfrag.workloads.spec import (
    MAX_ACCEPTANCE_PAIRS,
    MAX_DRAFT_TOKENS,
    MAX_LAYERS,
    MAX_SEED,
    FieldError,
    check_number,
    show,
    whole,
)
from kvfrag.workloads.table import WorkloadError
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

#: What `acceptance` reads as the request table's counts.
COLUMN = "column"
#: MTP layers of the model presets that have them (config.json's num_nextn_predict_layers):
#: deepseek-ai/DeepSeek-V3 1. Any other model: 1, vLLM's default where a config names none.
MTP_LAYERS: dict[str, int] = {"deepseek-v3": 1}
#: config.json fields that count a model's MTP layers, in the order vLLM reads them
#: (vllm/config/speculative.py: DeepSeek, GLM, MiMo ... num_nextn_predict_layers; Qwen3-Next
#: and Qwen3.5 mtp_num_hidden_layers).
MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
#: Allocator kinds that speculative decoding does not run on yet, and why.
NOT_MODELLED = {
    "hybrid": "the hybrid allocator with engine.speculative is not modelled yet",
    "floor": "floor with engine.speculative is not modelled yet",
    "static-partition": "static-partition with engine.speculative is not modelled yet",
    "two-level": "the two-level allocator with engine.speculative is not modelled yet",
    "prefix-caching": "prefix caching with engine.speculative is not modelled yet (EAGLE's "
                      "block hashes cover one more token)",
}


def _acceptance(value: Any) -> float | str | dict[str, tuple[tuple[int, float], ...]]:
    """A rate in [0, 1], `column`, or {distribution: [[accepted count, weight], ...]}."""
    if value == COLUMN:
        return COLUMN
    if isinstance(value, Mapping):
        if set(value) != {"distribution"}:
            extra = sorted(str(k) for k in value if k != "distribution")
            raise ValueError("a distribution is {distribution: [[accepted, weight], ...]}"
                             + (f"; unknown key {excerpt(extra[0])}" if extra else ""))
        pairs = value["distribution"]
        if not isinstance(pairs, list | tuple) or not pairs:
            what = "an empty list" if isinstance(pairs, list | tuple) else show(pairs)
            raise FieldError(("distribution",), "must be a non-empty list of [accepted count, "
                             f"weight] pairs, not {what}")
        if len(pairs) > MAX_ACCEPTANCE_PAIRS:
            raise FieldError(("distribution",), f"{len(pairs):,} pairs; at most "
                             f"{MAX_ACCEPTANCE_PAIRS:,}")
        out = []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise FieldError(("distribution", i), "must be a pair [accepted count, weight], "
                                 f"not {show(pair)}")
            try:
                count = int(check_number(pair[0], 0, MAX_DRAFT_TOKENS, whole=True))
            except ValueError as exc:
                raise FieldError(("distribution", i), f"accepted count {exc}") from None
            try:
                weight = float(check_number(pair[1], 0, 1e9))
            except ValueError as exc:
                raise FieldError(("distribution", i), f"weight {exc}") from None
            out.append((count, weight))
        if not sum(w for _, w in out) > 0:
            raise FieldError(("distribution",), "the weights sum to 0")
        return {"distribution": tuple(out)}
    try:
        return float(check_number(value, 0, 1))
    except ValueError:
        raise ValueError(f"must be a rate from 0 to 1, {{distribution: [[accepted, weight], "
                         f"...]}} or column, not {show(value)}") from None


class SpeculativeSpec(BaseModel):
    """`engine.speculative`: k drafts per decode step by `method`, their acceptance, the seed
    of its draws (None: the workload's), and the draft's KV layers (None: the method's
    default, `draft_layer_count`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    method: str
    num_tokens: whole(1, MAX_DRAFT_TOKENS)
    acceptance: Any
    seed: whole(0, MAX_SEED) | None = None
    draft_layers: whole(0, MAX_LAYERS) | None = None
    draft_model: str | None = None

    @field_validator("draft_model")
    @classmethod
    def _draft_model(cls, value: str | None) -> str | None:
        if value is not None and (value not in ARCHITECTURES or value not in GEOMETRIES):
            names = sorted(set(ARCHITECTURES) & set(GEOMETRIES))
            hint = nearest(value, names)
            raise ValueError(f"{excerpt(value)} is not a model preset"
                             + (f"; did you mean {hint!r}?" if hint else "")
                             + f" (presets: {', '.join(names)})")
        return value

    @field_validator("method")
    @classmethod
    def _method(cls, value: str) -> str:
        if value not in METHODS:
            raise ValueError(f"{excerpt(value)} is not a method: one of {', '.join(METHODS)}")
        return value

    @field_validator("acceptance")
    @classmethod
    def _acceptance(cls, value: Any) -> Any:
        return _acceptance(value)

    @model_validator(mode="after")
    def _fits(self) -> SpeculativeSpec:
        """Accepted counts within 0..num_tokens; draft layers where the method has a draft."""
        if isinstance(self.acceptance, dict):
            for i, (count, _) in enumerate(self.acceptance["distribution"]):
                if count > self.num_tokens:
                    raise FieldError(("acceptance", "distribution", i),
                                     f"accepted count {count} is outside 0..{self.num_tokens} "
                                     "(num_tokens)")
        if self.method == "ngram" and self.draft_layers:
            raise FieldError(("draft_layers",), "ngram proposes drafts from the prompt, with no "
                             "draft model: it keeps no KV layers (leave the key out or give 0)")
        if self.draft_model is not None:
            if self.method != "draft_model":
                raise FieldError(("draft_model",), f"method {self.method} has no draft model "
                                 "(give method: draft_model, or leave draft_model out)")
            if self.draft_layers is not None:
                raise FieldError(("draft_layers",), f"draft_model {self.draft_model!r} gives "
                                 "the draft's layers: leave draft_layers out")
        if self.method == "draft_model" and self.draft_layers is None and not self.draft_model:
            raise FieldError(("draft_layers",), "required with method draft_model: the KV "
                             "layers the draft model keeps, each counted in the target's layer "
                             "shape (e.g. draft_layers: 4), or give draft_model: a preset")
        return self

    @property
    def from_column(self) -> bool:
        return self.acceptance == COLUMN

    def resolve(self, default_seed: int) -> Speculative:
        """The engine's `Speculative`; the seed defaults to `default_seed` (the workload's)."""
        acc = self.acceptance
        return Speculative(
            self.method, self.num_tokens,
            rate=acc if isinstance(acc, float) else None,
            distribution=tuple(acc["distribution"]) if isinstance(acc, dict) else (),
            seed=default_seed if self.seed is None else self.seed,
        )

    def draft_layer_count(self, mtp_layers: int) -> int:
        """KV layers the draft keeps: as given, else EAGLE 1, MTP the model's `mtp_layers`,
        n-gram 0 (a draft model's is required)."""
        if self.draft_layers is not None:
            return self.draft_layers
        if self.draft_model is not None:
            return GEOMETRIES[self.draft_model].layers
        return {"eagle": 1, "mtp": mtp_layers}.get(self.method, 0)

    def draft_architecture(self) -> Architecture | None:
        """The draft model's shape, for its weights (None: no draft model named)."""
        return None if self.draft_model is None else ARCHITECTURES[self.draft_model]

    def draft_layer(self, tp: int, dtype_bytes: int) -> FullAttention | None:
        """One of the named draft model's KV layers on one GPU of `tp` (KV heads split, at
        least one each), in the KV cache's dtype; None: the target's shape."""
        if self.draft_model is None:
            return None
        geo = GEOMETRIES[self.draft_model]
        return FullAttention(max(geo.kv_heads // tp, 1), geo.head_dim, dtype_bytes)


def mtp_layers(model: Any) -> int:
    """MTP layers of a scenario's `model`: a preset's (`MTP_LAYERS`), a config.json's
    (`MTP_KEYS`, its text_config's too), else 1."""
    if isinstance(model, str):
        return MTP_LAYERS.get(model, 1)
    ref = getattr(model, "hf_config", None)
    config = getattr(ref, "config", None)
    for part in (config, config.get("text_config") if isinstance(config, Mapping) else None):
        if isinstance(part, Mapping):
            for key in MTP_KEYS:
                n = part.get(key)
                if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
                    return min(n, MAX_LAYERS)
    return 1


def draft_geometry(geo: KVGeometry, layers: int, layer: FullAttention | None = None) -> KVGeometry:
    """A full-attention model's geometry with `layers` draft layers of its own layer shape, or
    of `layer`'s (a named draft model's: the layers are then not alike, unless it is the same
    shape)."""
    if not layers:
        return geo
    if layer is not None and layer.bytes_per_token != 2 * geo.bytes_per_buffer_token:
        return replace(geo, layers=geo.layers + layers,
                       token_bytes=geo.bytes_per_token + layers * layer.bytes_per_token)
    if not geo.uniform:  # (only a stack gives such a geometry: `draft_stack` then)
        raise ValueError(f"model {geo.name!r}: its layers are not alike; add the draft's "
                         "layers to its stack")
    return replace(geo, layers=geo.layers + layers)


def draft_stack(stack: LayerStack, layers: int, layer: FullAttention | None = None) -> LayerStack:
    """`stack` with `layers` draft layers after its own: `layer` (a named draft model's), else
    the shape of its last attention layer keeping every token (EAGLE's is a decoder layer of
    the target's attention shape; DeepSeek's MTP layer is an MLA layer like the target's)."""
    if not layers:
        return stack
    if layer is not None:
        return LayerStack(stack.name, (*stack.layers, *(layer,) * layers))
    last = next((layer for layer in reversed(stack.layers)
                 if not isinstance(layer, MambaState)), None)
    if last is None:
        raise ValueError(f"model {stack.name!r} has no attention layer for a draft to copy")
    draft = last if isinstance(last, MLA) else last.as_full()
    return LayerStack(stack.name, (*stack.layers, *(draft,) * layers))


def refusal(spec: SpeculativeSpec, scenario: Any) -> tuple[tuple[str | int, ...], str] | None:
    """(field, message) of what speculative decoding does not run with in `scenario`
    (a `Scenario` being validated), or None."""
    e = scenario.engine
    if e.batching != "continuous":
        return (("engine", "batching"), "speculative decoding needs continuous batching "
                "(static batching with engine.speculative is not modelled)")
    for i, a in enumerate(scenario.allocators):
        if a.kind in NOT_MODELLED:
            return (("allocators", i), f"allocator {a.label!r}: {NOT_MODELLED[a.kind]}")
    w = scenario.workload
    if spec.from_column and w.synthetic is not None:
        return (("engine", "speculative", "acceptance"), "column reads the request table's "
                "accepted_drafts, which a synthetic workload has none of: give a rate or a "
                "distribution")
    for key in ("n", "beam_width"):
        if (getattr(w, key) or 1) > 1:
            return (("workload", key), "speculative decoding with sample groups or beams "
                    "(n > 1) is not modelled: leave it out or give 1")
    return None


def check_workload(spec: SpeculativeSpec | None, requests: pd.DataFrame, source: str) -> None:
    """What only the built request table shows: `acceptance: column` needs its
    `accepted_drafts`; sample groups and beams (n > 1) are not modelled. Raises
    `WorkloadError` naming `source` (and the first row)."""
    if spec is None:
        return
    if spec.from_column and "accepted_drafts" not in requests.columns:
        raise WorkloadError(f"{source}: engine.speculative.acceptance is column, but the request "
                            "table has no accepted_drafts column (give one, or a rate)")
    for col in ("n", "beam_width"):
        if col in requests.columns:
            over = (requests[col].to_numpy() > 1).nonzero()[0]
            if len(over):
                row = int(over[0])
                raise WorkloadError(
                    f"{source}: row {row + 1}, column {col}: {int(requests[col].iloc[row])}: "
                    "speculative decoding with sample groups or beams (n > 1) is not modelled"
                    f" ({len(over)} row(s) affected)")
