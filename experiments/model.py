"""A decoder-only transformer in flax.nnx for language-model pretraining experiments.

Pre-norm blocks: ``x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x))``, then a final RMSNorm and
an output head (tied to the token embedding or not). Attention is plain jnp, causal, with rotary
position embeddings on q and k; scores and softmax run in float32 whatever the compute dtype.

The MLP is SwiGLU (``down(silu(gate(x)) * up(x))``, three ``d_model x d_ff`` matrices), as in
LLaMA/PaLM: at equal ``d_ff`` it has 1.5x the parameters of a GELU MLP, which the presets count.
Initialization follows GPT-2: weights ~ N(0, 0.02), residual output projections scaled by
``1/sqrt(2 n_layers)``, so that the loss at init is close to ``log(vocab_size)``.

Blocks live in an ``nnx.List``, so the Param pytree from ``nnx.split(model, nnx.Param)`` has the
layer index in its path (``params["blocks"][i]``) and ``layer_of`` recovers it, which is how
Streaming-DiLoCo fragments select layers.

Example:
  >>> import jax, jax.numpy as jnp
  >>> cfg = preset("tiny")
  >>> graphdef, params = init_params(cfg, seed=0)
  >>> loss_fn = make_loss_fn(graphdef)
  >>> batch_BxLp1 = jax.random.randint(jax.random.key(0), (2, 17), 0, cfg.vocab_size)
  >>> loss = jax.jit(loss_fn)(params, batch_BxLp1)
  >>> bool(abs(loss - jnp.log(cfg.vocab_size)) < 0.1 * jnp.log(cfg.vocab_size))
  True
  >>> jax.eval_shape(nnx.merge(graphdef, params), batch_BxLp1[:, :-1])
  ShapeDtypeStruct(shape=(2, 16, 256), dtype=float32)
  >>> {name: round(param_count(preset(name)) / 1e6, 1) for name in PRESETS}
  {'tiny': 1.1, '150m': 151.9, '1b': 1204.9}

References: RoFormer (arXiv:2104.09864); RMSNorm (arXiv:1910.07467); GLU variants
(arXiv:2002.05202).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Transformer hyper-parameters, validated on construction (and on ``dataclasses.replace``).

    ``dtype`` is the compute dtype of matmuls and activations; ``param_dtype`` that of the
    stored parameters. Both are names from ``float32``, ``bfloat16``, ``float16``.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_seq_len: int
    dtype: str = "float32"
    param_dtype: str = "float32"
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    remat: bool = False  # recompute each block's activations in the backward pass

    def __post_init__(self):
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if not self.rope_base > 0:
            raise ValueError(f"rope_base must be positive, got {self.rope_base!r}")
        for field in ("dtype", "param_dtype"):
            if getattr(self, field) not in _DTYPES:
                raise ValueError(
                    f"{field} must be one of {sorted(_DTYPES)}, got {getattr(self, field)!r}"
                )
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = d_model / n_heads = {self.head_dim} must be even for RoPE "
                f"(d_model={self.d_model}, n_heads={self.n_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        return _DTYPES[self.dtype]

    @property
    def params_dtype(self) -> jnp.dtype:
        return _DTYPES[self.param_dtype]


PRESETS: dict[str, ModelConfig] = {
    # Byte-level toy model for tests and CPU runs: ~1.1M parameters.
    "tiny": ModelConfig(
        vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512, max_seq_len=128
    ),
    # GPT-2-small shape (tied, vocab padded to a multiple of 128): ~152M parameters.
    "150m": ModelConfig(
        vocab_size=50304, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_seq_len=1024
    ),
    # LLaMA-like shape with an untied head: ~1.2B parameters.
    "1b": ModelConfig(
        vocab_size=32000,
        d_model=2048,
        n_layers=16,
        n_heads=16,
        d_ff=8192,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Returns the preset ``name`` with ``overrides`` applied (and validated)."""
    if name not in PRESETS:
        raise ValueError(f"name must be one of {sorted(PRESETS)}, got {name!r}")
    return dataclasses.replace(PRESETS[name], **overrides)


def rope(x_BxLxHxK: jax.Array, positions_L: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding: rotates pairs ``(x_i, x_{i+K/2})`` by ``pos * base^(-2i/K)``.

    For a query at position p and a key at position m, ``rope(q, p) . rope(k, m)`` depends only
    on ``p - m``: each pair is a complex number multiplied by ``exp(i pos theta_i)``.
    """
    half = x_BxLxHxK.shape[-1] // 2
    inv_freq_F = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_LxF = positions_L.astype(jnp.float32)[:, None] * inv_freq_F[None, :]
    cos_1xLx1xF = jnp.cos(angle_LxF)[None, :, None, :]
    sin_1xLx1xF = jnp.sin(angle_LxF)[None, :, None, :]
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate(
        [x1 * cos_1xLx1xF - x2 * sin_1xLx1xF, x2 * cos_1xLx1xF + x1 * sin_1xLx1xF], axis=-1
    )
    return out.astype(x_BxLxHxK.dtype)


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale``, computed in float32."""

    def __init__(self, cfg: ModelConfig, eps: float = 1e-6):
        self.scale = nnx.Param(
            jnp.ones((cfg.d_model,), cfg.params_dtype), out_sharding=("embed",), **_LAZY
        )
        self.eps = eps

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x32 = x_BxLxD.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(x_BxLxD.dtype)


# Logical axes of every parameter, and the rules that lay them over the mesh (Megatron-style
# tensor parallelism over "model": attention heads, the MLP's hidden units and the vocabulary
# split; the residual width whole). FSDP, when asked for, adds "data" (co2jax.RoundTrainer).
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", "model"),
    ("heads", "model"),
    ("mlp", "model"),
    ("embed", None),
)
# the names are metadata only: the engine places the arrays (no mesh when the model is built)
_LAZY = {"eager_sharding": False}


def _linear(
    cfg: ModelConfig,
    d_in: int,
    d_out: int,
    rngs: nnx.Rngs,
    std: float = 0.02,
    axes: tuple[str, str] = ("embed", "embed"),
):
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.params_dtype,
        kernel_init=nnx.with_partitioning(nnx.initializers.normal(std), axes, **_LAZY),
        rngs=rngs,
    )


_IN_HEADS = ("embed", "heads")  # q, k, v: column-parallel over the heads
_OUT_HEADS = ("heads", "embed")  # o: row-parallel


class Attention(nnx.Module):
    """Causal multi-head self-attention with RoPE; scores and softmax in float32."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.config = cfg
        d, out_std = cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layers)
        self.q, self.k, self.v = (_linear(cfg, d, d, rngs, axes=_IN_HEADS) for _ in range(3))
        self.o = _linear(cfg, d, d, rngs, std=out_std, axes=_OUT_HEADS)

    def __call__(self, x_BxLxD: jax.Array, positions_L: jax.Array) -> jax.Array:
        B, L, D = x_BxLxD.shape
        H, K, base = self.config.n_heads, self.config.head_dim, self.config.rope_base
        q_BxLxHxK = rope(self.q(x_BxLxD).reshape(B, L, H, K), positions_L, base)
        k_BxLxHxK = rope(self.k(x_BxLxD).reshape(B, L, H, K), positions_L, base)
        v_BxLxHxK = self.v(x_BxLxD).reshape(B, L, H, K)
        s_BxHxLxL = jnp.einsum(
            "blhk,bmhk->bhlm", q_BxLxHxK, k_BxLxHxK, preferred_element_type=jnp.float32
        ) / jnp.sqrt(jnp.float32(K))
        causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
        s_BxHxLxL = jnp.where(causal_LxL, s_BxHxLxL, jnp.finfo(jnp.float32).min)
        p_BxHxLxL = jax.nn.softmax(s_BxHxLxL, axis=-1).astype(v_BxLxHxK.dtype)
        o_BxLxHxK = jnp.einsum("bhlm,bmhk->blhk", p_BxHxLxL, v_BxLxHxK)
        return self.o(o_BxLxHxK.reshape(B, L, D))


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.gate = _linear(cfg, cfg.d_model, cfg.d_ff, rngs, axes=("embed", "mlp"))
        self.up = _linear(cfg, cfg.d_model, cfg.d_ff, rngs, axes=("embed", "mlp"))
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.down = _linear(cfg, cfg.d_ff, cfg.d_model, rngs, out_std, axes=("mlp", "embed"))

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x_BxLxD)) * self.up(x_BxLxD))


class Block(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm, self.attn = RMSNorm(cfg), Attention(cfg, rngs)
        self.mlp_norm, self.mlp = RMSNorm(cfg), SwiGLU(cfg, rngs)

    def __call__(self, x_BxLxD: jax.Array, positions_L: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_L)
        return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))


class Transformer(nnx.Module):
    """Decoder-only LM: ``tokens_BxL`` (int) -> float32 ``logits_BxLxV``. Holds only Params."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size,
            config.d_model,
            dtype=config.compute_dtype,
            param_dtype=config.params_dtype,
            embedding_init=nnx.with_partitioning(
                nnx.initializers.normal(0.02), ("vocab", "embed"), **_LAZY
            ),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.n_layers)])
        self.final_norm = RMSNorm(config)
        if not config.tie_embeddings:
            self.head = _linear(
                config, config.d_model, config.vocab_size, rngs, axes=("embed", "vocab")
            )

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        L = tokens_BxL.shape[1]
        if L > self.config.max_seq_len:
            raise ValueError(f"sequence length {L} exceeds max_seq_len={self.config.max_seq_len}")
        positions_L = jnp.arange(L)
        x_BxLxD = self.embed(tokens_BxL)
        for block in self.blocks:
            if self.config.remat:  # keep only the block's input; the same values
                x_BxLxD = nnx.remat(_apply_block)(block, x_BxLxD, positions_L)
            else:
                x_BxLxD = block(x_BxLxD, positions_L)
        x_BxLxD = self.final_norm(x_BxLxD)
        tied = self.config.tie_embeddings
        w_DxV = self.embed.embedding[...].T if tied else self.head.kernel[...]
        w_DxV = w_DxV.astype(x_BxLxD.dtype)
        # Logits accumulate in float32 even for bf16 compute: the softmax over a large vocab
        # is where low precision hurts the loss most.
        return jnp.einsum("bld,dv->blv", x_BxLxD, w_DxV, preferred_element_type=jnp.float32)


def _apply_block(block, x_BxLxD: jax.Array, positions_L: jax.Array) -> jax.Array:
    return block(x_BxLxD, positions_L)


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable[[nnx.State, jax.Array], jax.Array]:
    """Returns ``loss_fn(params, batch_BxLp1)``: mean next-token cross-entropy.

    Inputs are ``batch[:, :-1]`` and targets ``batch[:, 1:]``. ``loss_fn`` is pure in
    ``params`` (the ``nnx.Param`` state), so it composes with jit, grad, vmap and shard_map.
    """

    def loss_fn(params: nnx.State, batch_BxLp1: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        logits_BxLxV = model(batch_BxLp1[:, :-1])
        losses_BxL = optax.softmax_cross_entropy_with_integer_labels(
            logits_BxLxV, batch_BxLp1[:, 1:]
        )
        return jnp.mean(losses_BxL)

    return loss_fn


def _split_params(config: ModelConfig, seed: Any) -> tuple[nnx.GraphDef, nnx.State]:
    # A single filter: nnx.split raises if the model held any non-Param state.
    return nnx.split(Transformer(config, nnx.Rngs(seed)), nnx.Param)


# Static config, traced key: one compilation per config, shared by every seed.
@functools.partial(jax.jit, static_argnums=0)
def _init_state(config: ModelConfig, key: jax.Array) -> nnx.State:
    return _split_params(config, key)[1]


def init_params(config: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Returns ``(graphdef, params)``, params initialized in one jitted program from ``seed``.

    The graphdef is the same for every seed; the params are deterministic given the seed.
    """
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0))))
    return graphdef, _init_state(config, jax.random.key(seed))


def param_count(config: ModelConfig) -> int:
    """Number of parameters, from shapes only (``jax.eval_shape``: nothing is allocated)."""
    abstract = jax.eval_shape(lambda: _split_params(config, 0)[1])
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))


def _path_key(entry: Any) -> Any:
    # DictKey.key, GetAttrKey.name, SequenceKey.idx; plain str/int entries pass through.
    return getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry)))


def layer_of(path: Sequence[Any]) -> int | None:
    """Block index of a Param path (``("blocks", 3, "attn", ...)``), or None outside blocks.

    Accepts key paths from ``jax.tree_util.tree_flatten_with_path`` on the ``nnx.State`` or its
    pure dict, and the plain tuples of ``nnx.to_flat_state(params)``.
    """
    keys = [_path_key(entry) for entry in path]
    for key, nxt in itertools.pairwise(keys):
        if key == "blocks":
            return int(nxt)
    return None


def partition_specs(params: Any, rules: Sequence = LOGICAL_RULES) -> Any:
    """A ``PartitionSpec`` over the mesh per parameter, from the logical axes every
    parameter declares and ``rules`` (logical name -> mesh axis): what
    :class:`co2jax.RoundTrainer` takes as ``param_specs``.

    Example:
      >>> _, params = init_params(preset("tiny"), seed=0)
      >>> specs = partition_specs(params)
      >>> up, embed = specs["blocks"][0]["mlp"]["up"]["kernel"], specs["embed"]["embedding"]
      >>> up.get_value(), embed.get_value()
      (P(None, 'model'), P('model', None))
    """
    logical = jax.tree.leaves(
        nnx.get_partition_spec(params), is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    mesh = [nn_partitioning.logical_to_mesh_axes(tuple(spec), rules) for spec in logical]
    return jax.tree.unflatten(jax.tree.structure(params), mesh)


def make_eval_fn(loss_fn: Callable, mesh) -> Callable:
    """``eval_fn(stacked_params, batch) -> [R]``: each replica's loss on the whole
    ``batch`` (replicated), in one program mapped over the replica axis (the parameters'
    layout inside a replica the compiler's)."""
    replica = PartitionSpec("replica")
    return jax.jit(
        jax.shard_map(
            lambda p, b: loss_fn(jax.tree.map(lambda x: x[0], p), b)[None],
            mesh=mesh,
            in_specs=(replica, PartitionSpec()),
            out_specs=replica,
            axis_names={"replica"},
        )
    )
