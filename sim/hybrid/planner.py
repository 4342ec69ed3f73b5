"""vLLM 0.33's KV-cache planning for hybrid models, step for step, in plain Python.

Before serving, vLLM turns a model's layers into *KV-cache groups* and a memory budget into a
number of *block ids*. Every later allocation (block tables, freeing of sliding windows) works
in those units, so a simulator of vLLM's hybrid manager must plan exactly as vLLM does:

1. **Mamba alignment** (`Platform._align_hybrid_block_size`, platforms/interface.py): in a
   model with attention and Mamba layers, the attention block grows until one attention page
   holds a Mamba state, and the Mamba page is padded to the attention page (Qwen3-Next:
   544-token blocks). Mamba's own block size is max_model_len, or the attention block size in
   "align" mode (`MambaModelConfig`, model_executor/models/config.py).
2. **Hybrid manager off** (`unify_hybrid_kv_cache_specs`, v1/core/kv_cache_planning.py):
   sliding-window and chunked-local layers are promoted to full attention (they keep every
   token); Mamba hybrids cannot be promoted and are refused.
3. **Grouping** (`get_kv_cache_groups`): one group when all layers are alike; otherwise
   `unify_kv_cache_spec_page_size` makes every layer's page the largest one (bigger blocks for
   smaller attention pages, padding for Mamba or non-dividing pages) and
   `_get_kv_cache_groups_uniform_page_size` splits each layer type into groups of equal size,
   `layers[i::n]`, the short ones implicitly padded ("Add 8 padding layers, may waste at most
   15.38% KV cache memory" for Gemma-3-27B).
4. **Sizing** (`get_kv_cache_configs`, `_get_kv_cache_bytes_per_block`,
   `get_kv_cache_config_from_groups`): a block id costs the largest group's bytes (all groups
   alias one pool); `num_blocks = budget // bytes_per_block`, block 0 included (the block pool
   keeps it as its null block: `usable_blocks` is one less). A budget that cannot hold one
   request of max_model_len (after the null block) is refused.
5. **Block sizes the scheduler sees** (`resolve_kv_cache_block_sizes`, v1/core/kv_cache_utils.py):
   the LCM of the groups' block sizes; prefix hashes at their GCD when prefix caching is on and
   no Mamba group is outside "align" mode, else at the LCM.

Assumed, as vLLM on a CUDA GPU with FlashAttention resolves them: a layer-outer KV layout
(`LBNHC`, no block-stride alignment), kernel blocks of multiples of 16 tokens, no tensor,
pipeline or decode-context parallelism, no speculative decoding, no KV connector, no
`num_gpu_blocks_override`, the block size given by the user (not picked by the backend).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    Layer,
    LayerStack,
    MambaState,
    SlidingWindow,
)

#: vLLM's `MambaCacheMode`.
MAMBA_CACHE_MODES = ("none", "align")
#: The layer types' names in a group (vLLM's spec classes in brackets): "full"
#: (FullAttentionSpec), "sliding_window" (SlidingWindowSpec), "chunked_local"
#: (ChunkedLocalAttentionSpec), "mla" (MLAAttentionSpec), "mamba" (MambaSpec).
KINDS = ("full", "sliding_window", "chunked_local", "mla", "mamba")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return value


@dataclass(frozen=True)
class Group:
    """One KV-cache group: layers of one type sharing one block table per request."""

    kind: str  # one of KINDS; "full" also for promoted sliding/chunked layers
    layers: tuple[int, ...]  # layer indices, in vLLM's order within the group
    padding: int  # layers this group is short of the group size (vLLM's padding layers)
    block_size: int  # tokens per block (Mamba: tokens per state block)
    layer_page_bytes: int  # one layer's page: bytes of one block in one layer (padded)
    page_bytes: int  # the group's bytes per block id: len(layers) x layer_page_bytes
    window: int | None = None  # sliding window or chunk, for those kinds (and when promoted)
    promoted: bool = False  # a sliding/chunked group kept as full attention (manager off)


@dataclass(frozen=True)
class Plan:
    """What vLLM decides before serving `model` in `budget_bytes` of KV memory."""

    model: str
    budget_bytes: int
    hybrid_manager: bool
    prefix_caching: bool
    mamba_cache_mode: str  # as vLLM resolved it (prefix caching forces "align")
    max_model_len: int
    groups: tuple[Group, ...]
    group_size: int  # layers per group (the padded size); 0 when every layer is one group
    #: vLLM's warnings per layer type, in its order: (kind, padding layers, "may waste at most"
    #: percent = padding / that type's layers x 100).
    padding_warnings: tuple[tuple[str, int, float], ...]
    block_size: int  # cache_config.block_size: the attention block size after Mamba alignment
    mamba_block_size: int | None  # cache_config.mamba_block_size (None without Mamba layers)
    mamba_page_bytes: int | None  # one Mamba layer's state, unpadded (largest Mamba layer)
    mamba_page_padded: int | None  # cache_config.mamba_page_size_padded (None: not padded)
    page_bytes: int  # bytes per block id (the largest group's), what every id costs
    num_blocks: int  # KVCacheConfig.num_blocks: budget // page_bytes, the null block included
    scheduler_block_size: int
    hash_block_size: int
    max_request_blocks: int  # block ids one max_model_len request may need (memory check)

    @property
    def padding_layers(self) -> int:
        """Padding layers over all groups (vLLM logs them per layer type)."""
        return sum(g.padding for g in self.groups)

    @property
    def usable_blocks(self) -> int:
        """Block ids requests can hold: block 0 is the pool's null block."""
        return self.num_blocks - 1

    @property
    def used_bytes(self) -> int:
        """The KV cache vLLM allocates: num_blocks x page_bytes (the rest of the budget idles)."""
        return self.num_blocks * self.page_bytes


@dataclass(frozen=True)
class _Spec:
    """One layer's `KVCacheSpec`, reduced to what planning reads."""

    kind: str
    layer: Layer  # its identity: two layers' specs are equal iff their layers are
    block_size: int
    page_bytes: int  # bytes of one block of this layer (padded where vLLM pads)
    window: int | None = None
    promoted: bool = False

    @property
    def attention(self) -> bool:
        return self.kind != "mamba"


def layer_kind(layer: Layer) -> str:
    """A layer's kind by vLLM's spec class (`KINDS`)."""
    if isinstance(layer, SlidingWindow):
        return "sliding_window"
    if isinstance(layer, ChunkedLocal):
        return "chunked_local"
    if isinstance(layer, FullAttention):
        return "full"
    if isinstance(layer, MLA):
        return "mla"
    if isinstance(layer, MambaState):
        return "mamba"
    raise TypeError(f"not a layer type kvfrag knows: {layer!r}")


def layer_window(layer: Layer) -> int | None:
    """A sliding layer's window, a chunked-local layer's chunk; None for the others."""
    if isinstance(layer, SlidingWindow):
        return layer.window
    if isinstance(layer, ChunkedLocal):
        return layer.chunk
    return None


def _align_hybrid_block_size(
    stack: LayerStack,
    block_size: int,
    mamba_cache_mode: str,
    kernel_block_size: int,
    mamba_checkpoint_alignment: int | None,
) -> tuple[int, int | None]:
    """(attention block size, padded Mamba page or None), as `Platform._align_hybrid_block_size`.

    The attention block becomes the smallest multiple of the kernel alignment (max of the
    backend's smallest kernel block and the block size; 128 for MLA; in "align" mode also a
    multiple of the Mamba layers' prefill-checkpoint alignment) whose page holds the largest
    Mamba state; the Mamba page is then padded to that attention page. vLLM reads one attention
    shape from the model config, so the attention layers must agree on bytes per token.
    """
    attn = stack.attention_layers
    per_token = {layer.bytes_per_token for layer in attn}
    if len(per_token) != 1:
        raise ValueError(
            f"model {stack.name!r}: a Mamba hybrid whose attention layers differ in bytes per "
            f"token ({sorted(per_token)}) is not modelled (vLLM aligns to one attention shape)"
        )
    (attn_page_1_token,) = per_token
    mamba_page = max(layer.state_bytes for layer in stack.layers if isinstance(layer, MambaState))
    use_mla = any(isinstance(layer, MLA) for layer in attn)
    alignment = max(kernel_block_size, block_size)
    if use_mla:
        alignment = max(alignment, 128)  # TRTLLM/FlashInfer MLA decode kernels
    if mamba_cache_mode == "align":
        alignment = math.lcm(alignment, mamba_checkpoint_alignment or 1)
    attn_block_size = alignment * _cdiv(mamba_page, alignment * attn_page_1_token)
    attn_block_size = kernel_block_size * _cdiv(attn_block_size, kernel_block_size)
    block_size = max(block_size, attn_block_size)
    attn_page = block_size * attn_page_1_token
    return block_size, (attn_page if attn_page != mamba_page else None)


def _mergeable(specs: list[_Spec]) -> bool:
    """vLLM's `is_kv_cache_spec_uniform`: `type(specs[0]).merge(specs)` succeeds.

    Full-attention specs merge when alike but for the window they record (promoted sliding or
    chunked layers); two different recorded windows make vLLM raise, not answer False.
    """
    first = specs[0]
    if first.kind == "full":
        if any(s.kind != "full" for s in specs):
            return False
        if len({(s.layer.as_full(), s.block_size, s.page_bytes) for s in specs}) != 1:
            return False
        windows = {
            kind: {s.window for s in specs if s.window is not None and s.layer.kind == kind}
            for kind in ("sliding_window", "chunked_local")
        }
        if any(len(w) > 1 for w in windows.values()):
            raise ValueError(
                "All attention layers in the same KV cache group must have the same window "
                "size (vLLM's FullAttentionSpec.merge_window_sizes)."
            )
        return not (windows["sliding_window"] and windows["chunked_local"])
    return all(s == first for s in specs)


def _uniform_type(specs: list[_Spec]) -> bool:
    """vLLM's `UniformTypeKVCacheSpecs.is_uniform_type`: one block size and one type of layer
    (full attention and MLA count as one type; sliding windows and chunks must be equal)."""
    if len({s.block_size for s in specs}) > 1:
        return False
    first = specs[0]
    if first.kind in ("full", "mla"):
        return all(s.kind in ("full", "mla") for s in specs)
    if first.kind == "mamba":
        return all(s.kind == "mamba" and s.page_bytes == first.page_bytes for s in specs)
    return all(s.kind == first.kind and s.window == first.window for s in specs)


def _promote_local(specs: list[_Spec]) -> list[_Spec]:
    """vLLM's `_promote_local_kv_cache_specs` (hybrid manager off): where full attention sits
    beside sliding-window or chunked-local layers, those become full attention (recording their
    window); anything still not one type is refused."""
    if _mergeable(specs) or _uniform_type(specs):
        return specs
    has_full = any(s.kind in ("full", "mla") for s in specs)
    has_local = any(s.kind in ("sliding_window", "chunked_local") for s in specs)
    promoted = specs
    if has_full and has_local:
        promoted = [
            replace(s, kind="full", promoted=True)
            if s.kind in ("sliding_window", "chunked_local")
            else s
            for s in specs
        ]
    if any(s.kind == "mamba" for s in specs):
        raise ValueError(
            "Mamba state cannot be promoted to full attention: a Mamba hybrid needs the "
            "hybrid KV-cache manager"
        )
    if not (_mergeable(promoted) or _uniform_type(promoted)):
        raise ValueError(
            "Failed to promote local KV cache specs to one unified type (vLLM refuses a model "
            "with these layer types without its hybrid KV-cache manager: "
            f"{sorted({s.kind for s in specs})})."
        )
    return promoted


def _unify_page_size(specs: list[_Spec]) -> list[_Spec]:
    """vLLM's `unify_kv_cache_spec_page_size`: every layer's page becomes the largest one.

    An attention layer whose page divides the largest gets a proportionally larger block; a
    Mamba layer, or a non-MLA attention layer whose page does not divide it, is padded; an MLA
    layer that does not divide it cannot be unified.
    """
    max_page = max(s.page_bytes for s in specs)
    out = []
    for s in specs:
        if s.page_bytes == max_page:
            out.append(s)
        elif s.kind == "mamba":
            out.append(replace(s, page_bytes=max_page))
        elif max_page % s.page_bytes == 0:
            ratio = max_page // s.page_bytes
            out.append(replace(s, block_size=s.block_size * ratio, page_bytes=max_page))
        elif s.kind != "mla":
            out.append(replace(s, page_bytes=max_page))
        else:
            raise ValueError(
                f"an MLA layer's page ({s.page_bytes} B) does not divide the largest page "
                f"({max_page} B) and cannot be padded: vLLM cannot unify this model's pages"
            )
    return out


def _group(
    index: list[int], specs: list[_Spec]
) -> tuple[list[tuple[list[int], _Spec]], int, list[tuple[str, int, float]]]:
    """vLLM's `_get_kv_cache_groups_uniform_page_size`: (groups, group size, warnings).

    Layers are bucketed by spec in order of first appearance; the group size is the smallest
    bucket's layer count, or the largest's when that is under 1.5 times the smallest; bucket i
    of n layers makes ceil(n / size) groups of `layers[j::groups]`.
    """
    buckets: dict[_Spec, list[int]] = {}
    for i, s in zip(index, specs, strict=True):
        buckets.setdefault(s, []).append(i)
    sizes = [len(layers) for layers in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < min(sizes) * 1.5:
        group_size = max(sizes)
    groups: list[tuple[list[int], _Spec]] = []
    warnings: list[tuple[str, int, float]] = []
    for spec, layers in buckets.items():
        padding = group_size - len(layers) % group_size
        if padding != group_size:
            warnings.append((spec.kind, padding, round(padding / len(layers) * 100, 2)))
        num_groups = _cdiv(len(layers), group_size)
        groups.extend((layers[j::num_groups], spec) for j in range(num_groups))
    return groups, group_size, warnings


def _max_blocks(
    spec: _Spec, max_model_len: int, max_in_flight_tokens: int, mode: str, checkpoint_blocks: int
) -> int:
    """Block ids one request of max_model_len may hold in a group of this spec
    (`max_memory_usage_bytes` / page): the figure vLLM's memory check sums over groups."""
    if spec.kind in ("full", "mla"):
        return _cdiv(max_model_len, spec.block_size)
    if spec.kind == "sliding_window":
        assert spec.window is not None
        tokens = min(spec.window - 1 + max_in_flight_tokens, max_model_len)
        return _cdiv(tokens, spec.block_size) + 1
    if spec.kind == "chunked_local":
        assert spec.window is not None
        return _cdiv(min(spec.window + max_in_flight_tokens, max_model_len), spec.block_size)
    return 2 + checkpoint_blocks if mode == "align" else 1


def plan(
    stack: LayerStack,
    budget_bytes: int,
    block_size: int = 16,
    hybrid_manager: bool = True,
    mamba_cache_mode: str = "none",
    *,
    max_model_len: int,
    prefix_caching: bool | None = None,
    max_num_batched_tokens: int = 8192,
    concurrent_batches: int = 2,
    kernel_block_size: int = 16,
    mamba_checkpoint_alignment: int | None = None,
) -> Plan:
    """Plan `stack`'s KV cache in `budget_bytes` as vLLM 0.33 does (see the module docstring).

    - `block_size`: `--block-size` (tokens per attention block before Mamba alignment).
    - `hybrid_manager`: False is `--disable-hybrid-kv-cache-manager` (vLLM's default on CPU,
      and for chunked local attention unless
      VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1).
    - `mamba_cache_mode` / `prefix_caching`: prefix caching None means on unless the model has
      Mamba layers in "none" mode. As vLLM's `MambaModelConfig` does, prefix caching turns
      "none" into "align" and its absence turns "align" into "none".
    - `max_num_batched_tokens` x `concurrent_batches` (2 with async scheduling, vLLM's default)
      is the in-flight allowance sliding and chunked groups reserve in the memory check.
    - `kernel_block_size`: the attention backend's smallest kernel block (FlashAttention: 16).
    - `mamba_checkpoint_alignment`: the Mamba layers' prefill-checkpoint alignment in "align"
      mode (None: Triton/FLA kernels; 64 for FlashInfer's gated delta net on Hopper, which also
      reserves one checkpoint block per request).
    """
    if not isinstance(stack, LayerStack):
        raise TypeError(f"stack must be a LayerStack, not {type(stack).__name__}")
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool):
        raise ValueError(f"budget_bytes must be an integer, not {budget_bytes!r}")
    for name, value in (
        ("block_size", block_size),
        ("max_model_len", max_model_len),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("concurrent_batches", concurrent_batches),
        ("kernel_block_size", kernel_block_size),
    ):
        _positive_int(name, value)
    if mamba_checkpoint_alignment is not None:
        _positive_int("mamba_checkpoint_alignment", mamba_checkpoint_alignment)
    if mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise ValueError(
            f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, not {mamba_cache_mode!r}"
        )

    layers = stack.layers
    has_mamba = any(isinstance(layer, MambaState) for layer in layers)
    has_attention = bool(stack.attention_layers)
    # MambaModelConfig.verify_and_update_config: prefix caching decides the Mamba mode.
    if prefix_caching is None:
        prefix_caching = not (has_mamba and mamba_cache_mode == "none")
    mode = ("align" if prefix_caching else "none") if has_mamba else mamba_cache_mode

    # Platform.update_block_size_for_backend -> _align_hybrid_block_size (model_config.is_hybrid).
    mamba_page_padded: int | None = None
    if has_mamba and has_attention:
        block_size, mamba_page_padded = _align_hybrid_block_size(
            stack, block_size, mode, kernel_block_size, mamba_checkpoint_alignment
        )
    mamba_block_size = (block_size if mode == "align" else max_model_len) if has_mamba else None
    mamba_page = (
        max(layer.state_bytes for layer in layers if isinstance(layer, MambaState))
        if has_mamba
        else None
    )
    checkpoint_blocks = 1 if (mode == "align" and mamba_checkpoint_alignment) else 0

    # The layers' specs (each layer's get_kv_cache_spec).
    specs: list[_Spec] = []
    for layer in layers:
        kind = layer_kind(layer)
        if isinstance(layer, MambaState):
            assert mamba_block_size is not None
            page = mamba_page_padded if mamba_page_padded is not None else layer.state_bytes
            specs.append(_Spec(kind, layer, mamba_block_size, page))
        else:
            page = block_size * layer.bytes_per_token
            specs.append(_Spec(kind, layer, block_size, page, layer_window(layer)))

    if not hybrid_manager:
        specs = _promote_local(specs)  # unify_hybrid_kv_cache_specs

    index = list(range(len(layers)))
    if _mergeable(specs) or _uniform_type(specs):
        # _get_kv_cache_groups_uniform_spec / _get_kv_cache_groups_uniform_type: one group.
        group_specs = [(index, specs[0])]
        pages = [sum(s.page_bytes for s in specs)]
        group_size, warnings = 0, []
        uniform = True
    else:
        specs = _unify_page_size(specs)
        group_specs, group_size, warnings = _group(index, specs)
        pages = [len(members) * spec.page_bytes for members, spec in group_specs]
        uniform = False

    groups = tuple(
        Group(
            kind=spec.kind,
            layers=tuple(members),
            padding=0 if uniform else group_size - len(members),
            block_size=spec.block_size,
            layer_page_bytes=spec.page_bytes,
            page_bytes=page,
            window=spec.window,
            promoted=spec.promoted,
        )
        for (members, spec), page in zip(group_specs, pages, strict=True)
    )
    # _get_kv_cache_bytes_per_block (layer-outer layout: each layer's stride is its page).
    page_bytes = max(pages)

    # get_kv_cache_configs: the memory check plans against the budget less the null block.
    in_flight = max_num_batched_tokens * concurrent_batches
    per_group = [
        _max_blocks(spec, max_model_len, in_flight, mode, checkpoint_blocks)
        for _, spec in group_specs
    ]
    max_request_blocks = sum(per_group)
    check_memory = budget_bytes - page_bytes
    if check_memory <= 0:
        raise ValueError(
            f"No available memory for the cache blocks: {budget_bytes} B do not exceed one "
            f"block id ({page_bytes} B, the null block) (vLLM's _check_enough_kv_cache_memory)"
        )
    needed = max_request_blocks * page_bytes
    if needed > check_memory:
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"{needed} B of KV cache are needed, more than the {check_memory} B available "
            "after the null block (vLLM's _check_enough_kv_cache_memory)"
        )
    num_blocks = budget_bytes // page_bytes

    # resolve_kv_cache_block_sizes.
    if len(groups) <= 1:
        scheduler_block_size = hash_block_size = block_size
    else:
        sizes = [g.block_size for g in groups]
        scheduler_block_size = math.lcm(*sizes)
        if not prefix_caching or (has_mamba and mode != "align"):
            hash_block_size = scheduler_block_size
        else:
            hash_block_size = math.gcd(*sizes)

    return Plan(
        model=stack.name,
        budget_bytes=budget_bytes,
        hybrid_manager=hybrid_manager,
        prefix_caching=prefix_caching,
        mamba_cache_mode=mode,
        max_model_len=max_model_len,
        groups=groups,
        group_size=group_size,
        padding_warnings=tuple(warnings),
        block_size=block_size,
        mamba_block_size=mamba_block_size,
        mamba_page_bytes=mamba_page,
        mamba_page_padded=mamba_page_padded,
        page_bytes=page_bytes,
        num_blocks=num_blocks,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        max_request_blocks=max_request_blocks,
    )
