"""The gated delta rule in chunks, as matmuls: the prefill kernel when no device kernel applies.

Within a chunk of C tokens, with gc the cumulative log decay from the chunk start, gamma = exp(gc)
and S the state entering the chunk, the per-token recurrence unrolls (the WY / UT form) to
    (I + L) [W_v | W_k] = [beta*V | beta*gamma*K],   L[t,s] = beta_t exp(gc_t - gc_s) k_t.k_s (s < t)
    U  = W_v - W_k S                                  (the deltas the chunk writes)
    O  = gamma*Q S + A U,                              A[t,s] = exp(gc_t - gc_s) q_t.k_s (s <= t)
    S' = exp(gc_C) S + (K exp(gc_C - gc))^T U
Everything that does not depend on S (L, A, (I + L)^-1, W_k) is computed for a block of chunks
and heads at once. The pass over chunks is then three [C, D] x [D, D] matmuls per chunk plus two
[C, C] x [C, D] ones: W_v = (I + L)^-1 diag(beta) V, read from V where it lies (no chunk-major
copy of V is made), and A U, whose sum with gamma Q S is copied straight into the output.

(I + L) is inverted through its decay-free twin I + L0 (see _precompute) by one batched
unit-lower-triangular solve against the identity, and W_v, W_k come from matmuls with the
inverse: on CPU a triangular solve with Dv + Dk right-hand sides is far slower than solving for
the C x C inverse and multiplying (docs/measuring.md, figures behind the code's choices). Q K^T, K K^T and the product with
K are done once per key head, the value heads of a group broadcast or stacked as matmul rows.

The default chunk is 32, not the usual 64: on the 2-core CPU this was tuned on, chunk 64 was
slower at every prompt length measured (the C^2 terms halve and the per-chunk matmuls are still
efficient; `python benchmarks/chunk_size.py`, figures in docs/measuring.md).
"""

from __future__ import annotations

import math

import torch

from pocketllm.ops.gated_delta.recurrent import check_shapes

DEFAULT_CHUNK_SIZE = 32
# Decays below exp(EXP_FLOOR) (about 1e-13, far under fp32 resolution) are not computed as such:
# left in, they and their products become subnormal floats, which the CPU's matmuls handle far
# more slowly than normal ones (docs/measuring.md). Per-token decays are set to zero there,
# pairwise ones held at it.
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


def _chunk_major(x: torch.Tensor, start: int, chunks: int, chunk: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens [start, start + chunks*chunk) of x ([T, H, D] or [T, H], any dtype) as fp32
    [chunks, H, chunk(, D)], zero past the end of the sequence; written into `out` when given."""
    T, H = x.shape[0], x.shape[1]
    rest = tuple(x.shape[2:])
    full = max(0, min(chunks, (T - start) // chunk))
    tail = min(T - start - full * chunk, chunk) if full < chunks else 0
    if out is None:
        out = torch.empty((chunks, H, chunk) + rest, dtype=torch.float32, device=x.device)
    # Padded tokens have k = v = beta = g = 0: they decay nothing and write nothing.
    if full < chunks:
        out[full:].zero_()
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
    dev = v.device
    if initial_state is None:
        S = torch.zeros(Hv, Dk, Dv, dtype=torch.float32, device=dev)
    else:
        S = initial_state.to(dtype=torch.float32, copy=True)
    vf = v.float()  # no copy when v is already fp32
    out = torch.empty(N * C, Hv, Dv, dtype=v.dtype, device=dev)
    # The chunk's queries scaled by gamma and keys by their decay to the chunk end, per value
    # head, made by one multiply per chunk into this reused buffer.
    QKs = torch.empty(Hk, G, 2, C, Dk, dtype=torch.float32, device=dev)
    Qg, Kd = QKs.view(Hv, 2, C, Dk).unbind(1)
    KdT = Kd.transpose(1, 2)
    U = torch.empty(Hv, C, Dv, dtype=torch.float32, device=dev)
    O = torch.empty(Hv, C, Dv, dtype=torch.float32, device=dev)
    chunks_per_block = max(1, BLOCK_ROWS // (Hv * C))
    for n0 in range(0, N, chunks_per_block):
        nb = min(chunks_per_block, N - n0)
        start = n0 * C
        QK, scales, Mv, Wk, A, chunk_decay = _precompute(q, k, g, beta, start, nb, C)
        if start + nb * C <= T:
            # V is read in place, [nb, Hv, C, Dv] as a strided view: the matmuls accept
            # rows Hv*Dv apart, and a chunk-major copy of V cost as much as the matmul.
            V = vf[start : start + nb * C].unflatten(0, (nb, C)).transpose(1, 2)
        else:
            V = _chunk_major(vf, start, nb, C)
        # Per-chunk views made by one unbind each: indexing inside the loop cost more than some
        # of the small ops it fed.
        per_chunk = zip(
            QK[:, :, None].unbind(0),
            scales.view(nb, Hk, G, 2, C, 1).unbind(0),
            Mv.unbind(0),
            V.unbind(0),
            Wk.unbind(0),
            A.unbind(0),
            out[start : start + nb * C].view(nb, C, Hv, Dv).transpose(1, 2).unbind(0),
            chunk_decay[:, :, None, None].unbind(0),
        )
        for qk_n, scale_n, mv_n, v_n, wk_n, a_n, out_n, decay_n in per_chunk:
            torch.mul(qk_n, scale_n, out=QKs)
            # U = W_v - W_k S, with W_v = Mv V made here from the in-place V.
            torch.bmm(mv_n, v_n, out=U)
            U.baddbmm_(wk_n, S, alpha=-1.0)
            # O = gamma Q S + A U, written straight to the chunk's rows of the output: U and O
            # stay in cache instead of going through block-sized buffers.
            torch.bmm(Qg, S, out=O)
            O.baddbmm_(a_n, U)
            out_n.copy_(O)
            S.mul_(decay_n)
            S.baddbmm_(KdT, U)
    return out[:T], S


def _precompute(q, k, g, beta, start: int, nb: int, C: int):
    """The state-free part of `nb` chunks from token `start`: Q and K chunk-major
    [nb, Hk, 2, C, Dk] (index 0 queries, 1 keys); gamma and each token's decay to the chunk end
    [nb, Hv, 2, C]; Mv = (I + L)^-1 diag(beta) [nb, Hv, C, C], so that W_v = Mv V; W_k
    [nb, Hv, C, Dk]; A [nb, Hv, C, C]; the whole-chunk decays [nb, Hv]."""
    Hk, Dk = k.shape[1], k.shape[2]
    dev = k.device
    QK = torch.empty(nb, Hk, 2, C, Dk, dtype=torch.float32, device=dev)
    _chunk_major(q, start, nb, C, out=QK[:, :, 0])
    K = _chunk_major(k, start, nb, C, out=QK[:, :, 1])  # [nb, Hk, C, Dk]
    b = _chunk_major(beta, start, nb, C)  # [nb, Hv, C]
    gc = _chunk_major(g, start, nb, C).cumsum_(-1)  # [nb, Hv, C]
    Hv = b.shape[1]
    G = Hv // Hk

    # Pairwise decay exp(gc_t - gc_s), zero above the diagonal. The exponent is clamped to
    # [EXP_FLOOR, 0]: the upper half is positive and would overflow, and very negative arguments
    # take the vectorised exp's slow path. What the floor leaves (~1e-13 instead of smaller) is
    # far under fp32 resolution next to the O(1) terms it is summed with, and is a normal
    # float, so no product of it comes out subnormal.
    decay = (gc[..., :, None] - gc[..., None, :]).clamp_(min=EXP_FLOOR, max=0.0).exp_().tril_()
    decay = decay.view(nb, Hk, G, C, C)
    # Key-space products once per key head, broadcast over the value heads of its group; Q K^T
    # and K K^T as one matmul of the stacked [Q; K] with K^T.
    QKK = torch.matmul(QK.view(nb, Hk, 2 * C, Dk), K.transpose(-1, -2)).view(nb, Hk, 2, 1, C, C)
    A = QKK[:, :, 0].mul(decay).view(nb, Hv, C, C)

    # With Gamma = diag(gamma), L = Gamma L0 Gamma^-1 where L0 = diag(beta) K K^T (strictly
    # lower) carries no decay, so (I + L)^-1 = Gamma (I + L0)^-1 Gamma^-1, i.e. T0 * decay
    # elementwise. L0's entries are O(1): the solve runs in fp32 without the subnormals a
    # decayed L produces (a chunk's decay can span more than the fp32 exponent range), and the
    # clamped decay scales each entry back down, to ~1e-13 at least. The solve is of the
    # transposed system because LAPACK returns column-major results: T0^T in column-major is
    # T0 row-major. With unitriangular=True only the strict triangle is read, so L0 needs no
    # masking, and T0 comes out exactly zero above the diagonal.
    L0 = QKK[:, :, 1].mul(b.view(nb, Hk, G, C, 1)).view(nb, Hv, C, C)
    eye = torch.eye(C, dtype=torch.float32, device=dev).expand(nb, Hv, C, C)
    T0b = torch.linalg.solve_triangular(L0.mT, eye, upper=True, unitriangular=True).mT
    T0b = T0b.mul_(b[:, :, None, :])  # (I + L0)^-1 diag(beta)
    del L0

    # gamma_t = exp(gc_t) and the decay to the chunk end exp(gc_last - gc_t), floored together.
    scales = torch.empty(nb, Hv, 2, C, dtype=torch.float32, device=dev)
    gc_last = gc[..., -1:]  # [nb, Hv, 1]
    scales[:, :, 0] = gc
    torch.sub(gc_last, gc, out=scales[:, :, 1])
    _floored_exp_(scales)
    gamma = scales[:, :, 0]  # [nb, Hv, C]
    chunk_decay = gamma[..., -1]  # exp(gc_last): [nb, Hv]

    # W_v = (I + L)^-1 diag(beta) V = Mv V, and W_k = (I + L)^-1 diag(beta gamma) K, whose
    # factor is Gamma T0 diag(beta) since decay_ts gamma_s = gamma_t: no decay needed there.
    Mv = T0b.mul(decay.view(nb, Hv, C, C))
    Mk = T0b.mul_(gamma[..., None])
    Wk = torch.matmul(Mk.view(nb, Hk, G * C, C), K).view(nb, Hv, C, Dk)
    return QK, scales, Mv, Wk, A, chunk_decay


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
