"""Communication: reducers (how payloads cross the replica axis), codecs and the reducer policy.

- :class:`Reducer`, the exact means (:func:`pmean`, :func:`all_gather_mean`,
  :func:`ring_mean`, :func:`all_gather_stacked`) and :class:`Encoded` payloads;
- compression formats (:class:`Codec`: ``none``, ``bf16``, ``fp8``, ``int8``, ``fp4``,
  ``2bit``, ``topk``) and the compressed collectives built on them;
- :mod:`co2jax.comm.policy`: where a reducer is chosen.
"""

from co2jax.comm import chunks, policy
from co2jax.comm.codecs import (
    FORMATS,
    Codec,
    bf16,
    fp4,
    fp8,
    int4,
    int8,
    make,
    none,
    topk,
    two_bit,
)
from co2jax.comm.compressed import all_gather_compressed, all_gather_topk, all_reduce_compressed
from co2jax.comm.dct import (
    all_gather_dct_topk,
    chunked_dct,
    chunked_idct,
    dct_basis,
    dct_chunk_shape,
    dct_topk,
)
from co2jax.comm.gossip import gossip_groups, gossip_mean, gossip_payload
from co2jax.comm.lowrank import FACTORS, all_gather_low_rank, encode_factors, initial_factors
from co2jax.comm.means import EXACT, exact_mean
from co2jax.comm.participation import check_weights, token_weights, weighted
from co2jax.comm.reducer import (
    Encoded,
    Reducer,
    all_gather_mean,
    all_gather_stacked,
    all_gather_tree,
    as_reducer,
    gather_bytes,
    pmean,
    ring_bytes,
    ring_mean,
    values,
)
from co2jax.comm.regions import (
    global_payload,
    region_payload,
    slow_link_bytes,
    two_level_mean,
)
from co2jax.comm.sparse_quant import (
    all_gather_topk_quantized,
    dequantize_values,
    quantize_values,
)
from co2jax.comm.staged import exchange, staged_mean

__all__ = [
    "check_weights",
    "token_weights",
    "weighted",
    "EXACT",
    "FORMATS",
    "Codec",
    "Encoded",
    "Reducer",
    "all_gather_compressed",
    "all_gather_dct_topk",
    "all_gather_mean",
    "all_gather_tree",
    "all_gather_stacked",
    "all_gather_topk",
    "all_gather_topk_quantized",
    "all_reduce_compressed",
    "as_reducer",
    "bf16",
    "chunks",
    "chunked_dct",
    "chunked_idct",
    "dct_basis",
    "dct_chunk_shape",
    "dct_topk",
    "dequantize_values",
    "exact_mean",
    "fp4",
    "fp8",
    "gather_bytes",
    "gossip_groups",
    "gossip_mean",
    "gossip_payload",
    "global_payload",
    "region_payload",
    "slow_link_bytes",
    "two_level_mean",
    "int8",
    "int4",
    "FACTORS",
    "all_gather_low_rank",
    "encode_factors",
    "initial_factors",
    "make",
    "none",
    "pmean",
    "policy",
    "quantize_values",
    "ring_bytes",
    "ring_mean",
    "staged_mean",
    "exchange",
    "topk",
    "two_bit",
    "values",
]
