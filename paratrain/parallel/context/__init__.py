"""Context parallelism (the `cp` axis): every sequence split over the cp ranks, attention by a ring.

- `split`: the load-balanced causal split (rank i holds chunks i and 2·cp−1−i of 2·cp) of tokens,
  labels and positions.
- `ring`: ring attention for causal attention, forward and backward, over the comm layer's p2p.
- `sdpa`: a plain model under cp: its inputs split and positions passed, its
  `F.scaled_dot_product_attention(is_causal=True)` calls answered by the ring (`ContextSharding`,
  which `parallelize(..., context=ContextParallel())` gives the `ParallelModel`).
"""
