"""Attention of a decode row over a long paged KV cache, against its references: the compiled bf16
kernel (split over threads by block ranges, each range's partials merged by log-sum-exp) against
attention_decode_reference on every instruction-set path, and the torch path (the pool read in
place, run by run of consecutive blocks) against torch's fused attention over the gathered cache.
Thousands of positions, odd lengths and block-boundary positions, blocks out of order in the
table, GQA ratios 1 to 6; and the compiled Gated DeltaNet decode block against its reference."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pocketllm import compiled
from pocketllm.layers.cache import BlockTable, KVPool, PagedKV
from pocketllm.layers.paged_attention import attention_core, cached_attention, decode_attention, gather_kv, write_kv
from pocketllm.ops.fused import kernels, reference

BF16_ULP = 2**-7
BS = 64
# (query heads, KV heads): GQA ratios 1 to 6.
GQA = [(2, 2), (4, 2), (6, 2), (8, 2), (5, 1), (6, 1)]
# One position, block boundaries either side, an odd length over thousands of positions.
POSITIONS = [0, 63, 64, 127, 4999]


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float) -> None:
    err = (got.float() - want.float()).abs()
    bound = ulps * BF16_ULP * want.float().abs().clamp_min(1e-3)
    assert bool((err <= bound).all()), f"worst {float((err / bound).max()):.2f} of the allowed {ulps} ulps"


def paged(pos: int, kv_heads: int, d: int, dtype, seed: int, run: bool = False):
    """A pool with room to spare, random contents, and a table holding positions 0..pos in blocks
    taken out of order from it (or, with `run`, in one run of consecutive ids)."""
    blocks = pos // BS + 1
    pool_blocks = blocks + 5
    ids = list(range(pool_blocks))
    random.Random(seed).shuffle(ids)
    ids = list(range(2, 2 + blocks)) if run else ids[:blocks]
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(pool_blocks, kv_heads, BS, d, generator=g).to(dtype)
    v = torch.randn(pool_blocks, kv_heads, BS, d, generator=g).to(dtype)
    table = BlockTable(torch.zeros(blocks + 1, dtype=torch.int32))
    table.ids[:blocks] = torch.tensor(ids, dtype=torch.int32)
    table.held = ids
    return PagedKV(KVPool(k, v), table)


def decode_args(heads: int, kv_heads: int, d: int, pos: int, seed: int, sharp: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    half = d // 4
    angle = torch.rand(half, generator=g) * 6
    # A large q norm scale makes the softmax peaked: the running max then moves between blocks.
    q_scale = (8.0 if sharp else 1.0) + 0.1 * torch.randn(d, generator=g)
    return dict(
        qkv=(2 * torch.randn(1, (2 * heads + 2 * kv_heads) * d, generator=g)).bfloat16(), q_scale=q_scale,
        k_scale=1 + 0.1 * torch.randn(d, generator=g), eps=1e-6, cos=angle.cos(), sin=angle.sin(), pos=pos, heads=heads,
        kv_heads=kv_heads, head_dim=d, scale=d**-0.5,
    )


@pytest.fixture(scope="module")
def isa_builds():
    """The attention kernel built for every instruction-set path, side by side (each a compiler run)."""
    with ThreadPoolExecutor(len(compiled.ISA_FLAGS)) as pool:
        for isa, (lib, why) in zip(compiled.ISA_FLAGS, pool.map(kernels.attention_library, compiled.ISA_FLAGS)):
            assert lib is not None, f"{isa}: {why}"


@pytest.mark.parametrize("isa", list(compiled.ISA_FLAGS))
@pytest.mark.parametrize("heads,kv_heads", GQA, ids=lambda x: str(x))
def test_compiled_attention_decode_matches_the_reference(isa_builds, isa, heads, kv_heads):
    for i, pos in enumerate(POSITIONS):
        # d 72: no path's vector width divides it; 128: the small preset's. Ranges: as many as
        # the threads, one, and more than the threads (their partials merged on one thread).
        d = 72 if i % 2 else 128
        for splits in ((None, 1, 3, 9) if pos == POSITIONS[-1] else (None, 3)):
            args = decode_args(heads, kv_heads, d, pos, seed=pos + heads, sharp=splits == 3)
            got_kv, want_kv = paged(pos, kv_heads, d, torch.bfloat16, seed=pos), paged(pos, kv_heads, d, torch.bfloat16, seed=pos)
            got = kernels.attention_decode(k_pool=got_kv.pool.k, v_pool=got_kv.pool.v, table=got_kv.table.ids, splits=splits, isa=isa, **args)
            want = reference.attention_decode_reference(k_pool=want_kv.pool.k, v_pool=want_kv.pool.v, table=want_kv.table.ids, **args)
            assert torch.equal(got_kv.pool.k, want_kv.pool.k) and torch.equal(got_kv.pool.v, want_kv.pool.v), f"pos {pos}: row pos written differently"
            assert_within_ulps(got, want, 2)


def test_attention_splits_fill_the_threads_only_for_a_long_cache():
    assert kernels.attention_splits(63, 2, 128, BS, threads=2) == 1
    assert kernels.attention_splits(8000, 2, 128, BS, threads=2) == 2
    assert kernels.attention_splits(8000, 1, 256, BS, threads=6) == 6
    # Never more ranges than blocks.
    assert kernels.attention_splits(600, 4, 256, BS, threads=64) == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", GQA, ids=lambda x: str(x))
def test_torch_decode_attention_reads_the_pool_in_place(dtype, heads, kv_heads):
    """decode_attention against torch's fused attention over the gathered cache, with tables out
    of order, and one long run of consecutive blocks."""
    d = 64
    for pos, run in [*((p, False) for p in POSITIONS), (67 * BS + 5, True)]:
        kv = paged(pos, kv_heads, d, dtype, seed=pos)
        q = (3 * torch.randn(heads, d, generator=torch.Generator().manual_seed(pos))).to(dtype)
        keys, values = gather_kv(kv, pos + 1)
        want = attention_core(q.float()[:, None], keys.float(), values.float(), pos, d**-0.5)[:, 0]
        got = decode_attention(q, kv, pos, d**-0.5)
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert_within_ulps(got, want, 1)


def test_cached_attention_of_many_rows():
    """Rows starting a sequence attend to their own keys without reading the pool back; rows
    continuing one read the whole cache: both as the gathered form gives."""
    heads, kv_heads, d, start, t = 6, 2, 64, 130, 70
    kv = paged(start + t - 1, kv_heads, d, torch.float32, seed=1)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    for s in (0, start):
        write_kv(kv, s, k, v)
        keys, values = gather_kv(kv, s + t)
        want = attention_core(q.transpose(0, 1), keys, values, s, d**-0.5).transpose(0, 1)
        torch.testing.assert_close(cached_attention(q, k, v, kv, s, d**-0.5), want, rtol=1e-5, atol=1e-5)


def test_rows_going_on_from_a_prefix_attend_alike_with_a_devices_aligned_causal_bias(monkeypatch):
    """A device's rows going on from a cached prefix take the bottom-right-aligned causal bias
    (which a fused kernel takes with GQA, where an explicit mask would send them to the math
    kernel): the attention the explicit mask gives, row i over keys 0..start+i."""
    from pocketllm.layers import paged_attention

    heads, kv_heads, d, start, t = 6, 2, 64, 130, 70
    g = torch.Generator().manual_seed(3)
    q = torch.randn(heads, t, d, generator=g)
    keys, values = (torch.randn(kv_heads, start + t, d, generator=g) for _ in range(2))
    want = attention_core(q, keys, values, start, d**-0.5)
    monkeypatch.setattr(paged_attention, "aligned_causal", lambda device: True)
    torch.testing.assert_close(attention_core(q, keys, values, start, d**-0.5), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hk,hv,dk", [(1, 2, 16), (2, 6, 128)], ids=["serial", "threaded"])
def test_compiled_gdn_decode_matches_the_reference(hk, hv, dk):
    """Steps of the compiled Gated DeltaNet block (one read-only and one read-write pass over the
    state, split over the threads for the larger state) against the torch reference: outputs,
    conv window and fp32 state after every step."""
    kernels.library()
    dv, k = dk, 4
    conv = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(hv)
    fixed = dict(
        taps=0.5 * torch.randn(k, conv, generator=g), neg_a=-torch.rand(hv, generator=g) - 0.1,
        dt_bias=torch.randn(hv, generator=g).bfloat16(), norm_w=(1 + 0.1 * torch.randn(dv, generator=g)).bfloat16(), eps=1e-6,
        hk=hk, hv=hv, dk=dk, dv=dv,
    )
    states = [(torch.zeros(k - 1, conv, dtype=torch.bfloat16), 0.1 * torch.randn(hv, dk, dv, generator=g)) for _ in range(2)]
    states[1] = (states[0][0].clone(), states[0][1].clone())
    for _ in range(6):
        proj = torch.randn(1, conv + hv * dv + 2 * hv, generator=g).bfloat16()
        got = kernels.gdn_decode(proj, conv_state=states[0][0], state=states[0][1], **fixed)
        want = reference.gdn_decode_reference(proj, conv_state=states[1][0], state=states[1][1], **fixed)
        assert_within_ulps(got, want, 2)
        assert torch.equal(states[0][0], states[1][0])
        torch.testing.assert_close(states[0][1], states[1][1], rtol=1e-4, atol=1e-5)
