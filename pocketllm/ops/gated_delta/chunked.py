"""The gated delta rule in chunks, as matmuls: the prefill kernel when no device kernel applies.

Within a chunk of C tokens, with gc the cumulative log decay from the chunk start, gamma = exp(gc)
and S the state entering the chunk, the per-token recurrence unrolls (the WY / UT form) to
    (I + L) [W_v | W_k] = [beta*V | beta*gamma*K],   L[t,s] = beta_t exp(gc_t - gc_s) k_t.k_s (s < t)
    U  = W_v - W_k S                                  (the deltas the chunk writes)
    O  = gamma*Q S + A U,                              A[t,s] = exp(gc_t - gc_s) q_t.k_s (s <= t)
    S' = exp(gc_C) S + (K exp(gc_C - gc))^T U
Everything that does not depend on S (L, A, W_v, W_k) is computed for a block of chunks and heads
at once; the pass over chunks is then three [C, D] x [D, D] matmuls per chunk, and A U is one
batched matmul per block once the pass has produced the block's U.

(I + L) is inverted by one batched unit-lower-triangular solve against the identity and W_v, W_k
come from matmuls with the inverse: on CPU a triangular solve with Dv + Dk right-hand sides is
~10x slower than solving for the C x C inverse and multiplying. Q K^T, K K^T and the product with
K are done once per key head, the value heads of a group broadcast or stacked as matmul rows.

The default chunk is 32, not the usual 64: on a 2-core AVX-512 CPU it measured 15-25% faster at
100 to 4096 tokens (the C^2 terms halve and the per-chunk matmuls are still efficient).
"""

from __future__ import annotations

import math

import torch

from pocketllm.ops.gated_delta.naive import check_shapes

DEFAULT_CHUNK_SIZE = 32
# Decay weights below exp(EXP_FLOOR) (about 1e-13, far under fp32 resolution) are set to zero.
# Left in, they and their products become subnormal floats, which made the CPU matmuls up to
# 6x slower on realistic gates.
EXP_FLOOR = -30.0
# Token x value-head rows per precompute block: bounds the intermediates (a few floats per row
# per head dim) to a few MB that the allocator reuses. Larger blocks allocate past glibc's mmap
# threshold and pay page faults on every call; smaller ones pay per-op overhead.
BLOCK_ROWS = 6144


def _floored_exp_(x: torch.Tensor) -> torch.Tensor:
    """exp in place, exactly 0 where the argument is below EXP_FLOOR.

    The argument is clamped first: exp of -inf or of very negative numbers takes a slow path in
    the vectorised exp, several times slower than the finite case.
    """
    x.clamp_(min=EXP_FLOOR - 1.0).exp_()
    return torch.nn.functional.threshold_(x, math.exp(EXP_FLOOR), 0.0)


def _chunk_major(x: torch.Tensor, start: int, chunks: int, chunk: int) -> torch.Tensor:
    """Tokens [start, start + chunks*chunk) of x ([T, H, D] or [T, H], any dtype) as fp32
    [chunks, H, chunk(, D)], zero past the end of the sequence."""
    T, H = x.shape[0], x.shape[1]
    rest = tuple(x.shape[2:])
    full = max(0, min(chunks, (T - start) // chunk))
    tail = min(T - start - full * chunk, chunk) if full < chunks else 0
    # Padded tokens have k = v = beta = g = 0: they decay nothing and write nothing.
    alloc = torch.empty if full == chunks else torch.zeros
    out = alloc((chunks, H, chunk) + rest, dtype=torch.float32, device=x.device)
    stop = start + full * chunk
    out[:full].copy_(x[start:stop].unflatten(0, (full, chunk)).transpose(1, 2))
    if tail > 0:
        out[full, :, :tail].copy_(x[stop : stop + tail].transpose(0, 1))
    return out


def gated_delta_rule_chunked(q, k, v, g, beta, initial_state=None, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Same contract as gated_delta_rule_recurrent: (out [T, Hv, Dv] in v's dtype, final_state
    [Hv, Dk, Dv] fp32)."""
    T, Hk, Hv, Dk, Dv = check_shapes(q, k, v, g, beta, initial_state)
    G = Hv // Hk
    # A prompt shorter than a chunk is one chunk of its own length: no padding work.
    C = max(1, min(chunk_size, T))
    N = -(-T // C)
    if initial_state is None:
        S = torch.zeros(Hv, Dk, Dv, dtype=torch.float32, device=v.device)
    else:
        S = initial_state.to(dtype=torch.float32, copy=True)
    out = torch.empty(N * C, Hv, Dv, dtype=v.dtype, device=v.device)
    Qg = torch.empty(Hv, C, Dk, dtype=torch.float32, device=v.device)
    Kd = torch.empty(Hv, C, Dk, dtype=torch.float32, device=v.device)
    chunks_per_block = max(1, BLOCK_ROWS // (Hv * C))
    for n0 in range(0, N, chunks_per_block):
        nb = min(chunks_per_block, N - n0)
        Q, K, gamma, to_end, Wv, Wk, A, chunk_decay = _precompute(q, k, v, g, beta, n0 * C, nb, C)
        O = torch.empty(nb, Hv, C, Dv, dtype=torch.float32, device=v.device)
        for n in range(nb):
            # Queries and keys scaled per value head here rather than for the whole block: the
            # chunk-sized results stay in cache for the matmuls that read them.
            torch.mul(Q[n, :, None], gamma[n].view(Hk, G, C, 1), out=Qg.view(Hk, G, C, Dk))
            torch.mul(K[n, :, None], to_end[n].view(Hk, G, C, 1), out=Kd.view(Hk, G, C, Dk))
            # U = W_v - W_k S in place: Wv holds the block's U once the pass is done.
            U = Wv[n].baddbmm_(Wk[n], S, alpha=-1.0)  # [Hv, C, Dv]
            torch.bmm(Qg, S, out=O[n])
            S.mul_(chunk_decay[n, :, None, None])
            S.baddbmm_(Kd.transpose(1, 2), U)
        # The intra-chunk term A U for the whole block: one batched matmul rather than a small
        # one per chunk inside the pass.
        O.view(nb * Hv, C, Dv).baddbmm_(A.view(nb * Hv, C, C), Wv.view(nb * Hv, C, Dv))
        out[n0 * C : (n0 + nb) * C].view(nb, C, Hv, Dv).copy_(O.transpose(1, 2))
    return out[:T], S


def _precompute(q, k, v, g, beta, start: int, nb: int, C: int):
    """The state-free part of `nb` chunks from token `start`: Q, K [nb, Hk, C, Dk]; gamma and the
    decay of each token to the chunk end [nb, Hv, C]; W_v [nb, Hv, C, Dv], W_k [nb, Hv, C, Dk],
    A [nb, Hv, C, C]; the whole-chunk decays [nb, Hv]."""
    Q = _chunk_major(q, start, nb, C)  # [nb, Hk, C, Dk]
    K = _chunk_major(k, start, nb, C)  # [nb, Hk, C, Dk]
    V = _chunk_major(v, start, nb, C)  # [nb, Hv, C, Dv]
    b = _chunk_major(beta, start, nb, C)  # [nb, Hv, C]
    gc = _chunk_major(g, start, nb, C).cumsum_(-1)  # [nb, Hv, C]
    Hk, Dk, Hv = K.shape[1], K.shape[3], V.shape[1]
    G = Hv // Hk

    # Pairwise decay exp(gc_t - gc_s), zero above the diagonal. The upper half is positive and
    # would overflow, so it is masked before the exp.
    upper = torch.ones(C, C, dtype=torch.bool, device=v.device).triu_(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill_(upper, EXP_FLOOR - 1.0)
    decay = _floored_exp_(decay)  # [nb, Hv, C, C]
    negligible = decay == 0  # [nb, Hv, C, C]
    decay = decay.view(nb, Hk, G, C, C)
    # Key-space products once per key head, broadcast over the value heads of its group.
    L = torch.matmul(K, K.transpose(-1, -2))[:, :, None].mul(decay).view(nb, Hv, C, C)
    L.mul_(b[..., None])
    A = torch.matmul(Q, K.transpose(-1, -2))[:, :, None].mul(decay).view(nb, Hv, C, C)
    del decay

    # Tinv[t, s] is of order exp(gc_t - gc_s). The solve runs in fp64: in fp32, a chunk whose
    # decay spans more than the fp32 exponent range fills the solve with subnormals (2-3x
    # slower); fp64 has the range, and entries whose decay was floored are zeroed after.
    # It solves the transposed system because LAPACK returns column-major results: Tinv^T in
    # column-major is Tinv row-major. With unitriangular=True only the strict triangle is read.
    eye = torch.eye(C, dtype=torch.float64, device=v.device).expand(nb, Hv, C, C)
    Tinv = torch.linalg.solve_triangular(L.double().mT, eye, upper=True, unitriangular=True).mT
    Tinv = Tinv.masked_fill_(negligible, 0.0).float()  # [nb, Hv, C, C]
    del L, negligible

    gamma = _floored_exp_(gc.clone())  # [nb, Hv, C]
    Wv = torch.matmul(Tinv * b[:, :, None, :], V)  # [nb, Hv, C, Dv]
    Mk = Tinv.mul_((b * gamma)[:, :, None, :])
    # Row t of W_k is of order gamma_t. Where that is floored to zero, the row's products of
    # small factors would otherwise come out subnormal instead of zero.
    Mk.masked_fill_((gamma == 0)[..., None], 0.0)
    Wk = torch.matmul(Mk.view(nb, Hk, G * C, C), K).view(nb, Hv, C, Dk)

    gc_last = gc[..., -1:]  # [nb, Hv, 1]
    to_end = _floored_exp_(gc_last - gc)  # [nb, Hv, C]
    chunk_decay = _floored_exp_(gc_last[..., 0].clone())  # [nb, Hv]
    return Q, K, gamma, to_end, Wv, Wk, A, chunk_decay


def matmul_flops(T: int, Hk: int, Hv: int, Dk: int, Dv: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """The matmul FLOPs gated_delta_rule_chunked performs (padding included), for rate figures."""
    C = max(1, min(chunk_size, T))
    N = -(-T // C)
    # Q K^T and K K^T per key head.
    per_key_head = 2 * 2 * C * C * Dk
    # The triangular solve against the identity (C^2 per right-hand side), W_v and W_k, the pass's
    # W_k S, gamma Q S and K^T U, and A U.
    per_value_head = C**3 + 2 * C * C * (Dv + Dk) + 3 * 2 * C * Dk * Dv + 2 * C * C * Dv
    return N * (Hk * per_key_head + Hv * per_value_head)
