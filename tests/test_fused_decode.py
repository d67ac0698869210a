"""The compiled decode ops (pocketllm.ops.fused) against their torch forms: each call alone, and
whole bf16 decode steps of an engine with them against one without."""

from __future__ import annotations

import pytest
import torch

from conftest import feed

from pocketllm.distributed.policy import RulePolicy
from pocketllm.distributed.state import set_tp
from pocketllm.engine.runner import Engine
from pocketllm.loader.random_weights import RandomWeights
from pocketllm.ops.fused import ENV_FUSED, decode_ops, kernels, reference
from pocketllm.presets import get_preset

BF16_ULP = 2**-7


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float) -> None:
    """|got - want| <= ulps bf16 roundings of |want| (at least of 1e-3)."""
    err = (got.float() - want.float()).abs()
    bound = ulps * BF16_ULP * want.float().abs().clamp_min(1e-3)
    assert bool((err <= bound).all()), f"worst {float((err / bound).max()):.2f} of the allowed {ulps} ulps"


def test_compiled_ops_are_used_for_bf16_on_cpu():
    ops = decode_ops(torch.bfloat16, torch.device("cpu"), env={})
    assert ops.compiled and ops.describe() == "decode ops: compiled"
    assert not decode_ops(torch.float32, torch.device("cpu"), env={}).compiled
    off = decode_ops(torch.bfloat16, torch.device("cpu"), env={ENV_FUSED: "0"})
    assert not off.compiled and ENV_FUSED in off.describe()
    # On a device it turns off the Triton ops as well, and their line says why (no device asked:
    # the switch is read before any probe).
    off_gpu = decode_ops(torch.bfloat16, torch.device("cuda"), env={ENV_FUSED: "0"})
    assert not off_gpu.device.kernels and off_gpu.device.describe() == f"device ops: torch ({ENV_FUSED}=0)"


@pytest.mark.parametrize("n", [64, 1024, 1001])
def test_add_rms_norm_and_silu_mul_match_torch(n):
    torch.manual_seed(n)
    kernels.library()
    h, x = torch.randn(1, n, dtype=torch.bfloat16) * 3, torch.randn(1, n, dtype=torch.bfloat16)
    scale = 1 + 0.1 * torch.randn(n)
    for residual in (x, None):
        got_h, got_y = kernels.add_rms_norm(h, residual, scale, 1e-6)
        want_h, want_y = reference.add_rms_norm_reference(h, residual, scale, 1e-6)
        assert torch.equal(got_h, want_h)
        assert_within_ulps(got_y, want_y, 1)
    gate, up = torch.randn(1, n, dtype=torch.bfloat16) * 4, torch.randn(1, n, dtype=torch.bfloat16)
    assert_within_ulps(kernels.silu_mul(gate, up), reference.silu_mul_reference(gate, up), 1)


@pytest.mark.parametrize("t", [1, 2, 3, 40, 257])
def test_prompt_rows_conv_and_gated_norm_match_torch(t):
    # The compiled rows forms a prompt segment takes (a view's rows, a stride apart; fewer rows
    # than the conv window, and more than the threads' split), against the torch forms.
    from pocketllm.ops.causal_conv import causal_conv1d_prefill_
    from pocketllm.ops.norms import rms_norm_gated

    torch.manual_seed(t)
    kernels.library()
    ch, k, hv, dv = 72, 4, 3, 40
    proj = torch.randn(t, ch + hv * dv + 5, dtype=torch.bfloat16) * 2
    x, z = proj[:, :ch], proj[:, ch : ch + hv * dv]
    taps = torch.randn(k, ch)
    state = torch.randn(k - 1, ch, dtype=torch.bfloat16)
    want_state = state.clone()
    want = causal_conv1d_prefill_(x, taps, want_state)
    got = kernels.conv_silu_rows(x, taps, state)
    assert torch.equal(state, want_state)
    assert_within_ulps(got, want, 1)
    o = torch.randn(t, hv, dv, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(dv)).bfloat16()
    assert_within_ulps(kernels.rms_norm_gated_rows(o, z.view(t, hv, dv), w, 1e-6), rms_norm_gated(o, z.view(t, hv, dv), w, 1e-6), 1)
    with pytest.raises(ValueError, match="conv_silu_rows_bf16: taps must be float32"):
        kernels.conv_silu_rows(x, taps.bfloat16(), state)
    with pytest.raises(ValueError, match="rms_norm_gated_rows_bf16: weight must be bfloat16"):
        kernels.rms_norm_gated_rows(o, z.view(t, hv, dv), w.float(), 1e-6)


def engine(monkeypatch, fused: bool, cfg):
    monkeypatch.setenv(ENV_FUSED, "1" if fused else "0")
    set_tp(0, 1)
    return Engine(cfg, RandomWeights(cfg), torch.bfloat16, torch.device("cpu"), RulePolicy())


@pytest.mark.parametrize("head_dim", [16, 128], ids=lambda d: f"head{d}")
def test_decode_steps_with_and_without_the_compiled_ops(monkeypatch, head_dim):
    """Teacher-forced decode of two sequences from their prompts, one row each per pass: every
    step's logits, and the GDN states they leave, agree within bf16 rounding (the two differ in
    fp32 summation order only). The steps cross a KV block boundary, and the two sequences' blocks
    interleave in the pool, so the compiled attention reads through a table that is not the
    identity."""
    base = get_preset("tiny")
    cfg = base if head_dim == 16 else base.__class__(**{**base.__dict__, "linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim})
    fast, plain = engine(monkeypatch, True, cfg), engine(monkeypatch, False, cfg)
    assert fast.model.layers[0].mixer.compiled_decode is not None
    assert plain.model.layers[0].mixer.compiled_decode is None
    assert fast.model.layers[3].mixer.compiled_decode is not None and plain.model.layers[3].mixer.compiled_decode is None
    prompts = [[(7 * i + 3 + s) % 1000 for i in range(60)] for s in (0, 1)]
    steps = [(11 * i + 1) % 1000 for i in range(10)]
    for e in (fast, plain):
        e.reserve_slots(2, 70)
        for slot, p in enumerate(prompts):
            feed(e, p, slot=slot)
    for pos, token in enumerate(steps, start=60):
        spans = [(slot, pos, torch.tensor([token + slot])) for slot in (0, 1)]
        a, b = fast.run_packed(spans), plain.run_packed(spans)
        # Logits of a random tiny model are O(1): allow a few bf16 roundings of their range.
        assert (a - b).abs().max().item() <= 8 * BF16_ULP * b.abs().max().item()
    assert [t.held for t in fast.slots.blocks.tables] == [[0, 2], [1, 3]]
    for slot in (0, 1):
        for sa, sb in zip(fast.slots[slot], plain.slots[slot]):
            if hasattr(sa, "recurrent"):
                torch.testing.assert_close(sa.recurrent, sb.recurrent, atol=2e-2, rtol=2e-2)
                assert_within_ulps(sa.conv, sb.conv, 1)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_several_sequences_decode_rows_get_each_rows_bits_in_one_call(rows):
    # gdn_decode_rows: the GDN block of several sequences' decode rows in one call, each row's
    # states a slot of stacked tensors (not in row order), against gdn_decode row by row, and
    # within rounding of the plain reference.
    torch.manual_seed(rows)
    kernels.library()
    hk, hv, dk, dv, k = 2, 6, 32, 40, 4
    conv = 2 * hk * dk + hv * dv
    width = conv + hv * dv + 2 * hv
    proj = (torch.randn(rows, width + 5) * 2).to(torch.bfloat16)[:, :width]  # rows a stride apart
    taps, neg_a, dt_bias = torch.randn(k, conv) * 0.3, -torch.rand(hv), torch.randn(hv).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(dv)).to(torch.bfloat16)
    slots = torch.randperm(rows + 2)[:rows].tolist()
    conv0, state0 = torch.randn(rows + 2, k - 1, conv).to(torch.bfloat16), torch.randn(rows + 2, hv, dk, dv) * 0.1
    args = (taps, neg_a, dt_bias, norm_w, 1e-6)

    conv_a, state_a = conv0.clone(), state0.clone()
    got = kernels.gdn_decode_rows(proj, taps, [conv_a[s] for s in slots], neg_a, dt_bias, norm_w, 1e-6, [state_a[s] for s in slots], hk, hv, dk, dv)
    conv_b, state_b = conv0.clone(), state0.clone()
    alone = torch.cat([
        kernels.gdn_decode(proj[r : r + 1], taps, conv_b[s], neg_a, dt_bias, norm_w, 1e-6, state_b[s], hk, hv, dk, dv) for r, s in enumerate(slots)
    ])
    assert torch.equal(got, alone) and torch.equal(state_a, state_b) and torch.equal(conv_a, conv_b)
    conv_c, state_c = conv0.clone(), state0.clone()
    want = reference.gdn_decode_rows_reference(proj, *args[:1], [conv_c[s] for s in slots], *args[1:], [state_c[s] for s in slots], hk, hv, dk, dv)
    assert_within_ulps(got, want, 4)
    torch.testing.assert_close(state_a, state_c, atol=1e-5, rtol=1e-4)
    assert torch.equal(conv_a, conv_c)
    if rows > 1:
        # Two rows on one state would race: refused, naming why.
        with pytest.raises(ValueError, match="two rows share a state"):
            kernels.gdn_decode_rows(proj, taps, [conv_a[slots[0]]] * rows, neg_a, dt_bias, norm_w, 1e-6, [state_a[slots[0]]] * rows, hk, hv, dk, dv)
    with pytest.raises(ValueError, match=r"gdn_decode_rows_bf16: 2 rows of proj, 1 conv states"):
        kernels.gdn_decode_rows(torch.zeros(2, width, dtype=torch.bfloat16), taps, [conv_a[0]], neg_a, dt_bias, norm_w, 1e-6, [state_a[0]], hk, hv, dk, dv)


@pytest.mark.parametrize("isa", ["avx512f", "avx2"])
def test_a_narrower_build_gives_the_native_builds_bits(isa):
    # The element-wise loops (SiLU's exp, the roundings, the norms) run vectorized on every x86
    # path, so an AVX2 or AVX-512F build computes each element as the widest build does: the same
    # bits, NaN, infinities and the exp clamp's edges included. (Built for what the CPU has where
    # it lacks the named set: then the two builds are one.)
    from pocketllm import compiled

    assert isa in compiled.ISA_FLAGS
    torch.manual_seed(0)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 88.5, -87.5, 1e-30, -0.0, 3e38])

    def with_specials(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[: specials.numel()] = specials.to(t.dtype)
        return t

    n, rows = 1001, 5
    gate_up = with_specials((torch.randn(rows, 2 * n) * 6).to(torch.bfloat16))
    h, x = (torch.randn(rows, n) * 3).to(torch.bfloat16), with_specials(torch.randn(rows, n).to(torch.bfloat16))
    scale = 1 + 0.1 * torch.randn(n)
    hk, hv, dk, dv, k = 2, 4, 32, 24, 4
    conv = 2 * hk * dk + hv * dv
    proj = with_specials((torch.randn(1, conv + hv * dv + 2 * hv) * 2).to(torch.bfloat16))
    taps, neg_a, dt_bias = torch.randn(k, conv), -torch.rand(hv), torch.randn(hv).to(torch.bfloat16)
    norm_w, state0, conv0 = (1 + 0.1 * torch.randn(dv)).to(torch.bfloat16), torch.randn(hv, dk, dv) * 0.1, torch.randn(k - 1, conv).to(torch.bfloat16)

    def run(lib) -> list[torch.Tensor]:
        silu = torch.empty(rows, n, dtype=torch.bfloat16)
        lib.silu_mul_rows_bf16(gate_up.data_ptr(), gate_up.data_ptr() + n * 2, 2 * n, n, rows, silu.data_ptr())
        h_out, y = torch.empty_like(h), torch.empty_like(h)
        lib.add_rms_norm_rows_bf16(h.data_ptr(), x.data_ptr(), scale.data_ptr(), 1e-6, n, rows, h_out.data_ptr(), y.data_ptr())
        state, conv_state, out = state0.clone(), conv0.clone(), torch.empty(1, hv * dv, dtype=torch.bfloat16)
        # This build's own scratch size: gdn_work reads the library library() loaded.
        work = torch.empty(lib.gdn_work_floats(hk, hv, dk, dv), dtype=torch.float32)
        lib.gdn_decode_bf16(
            proj.data_ptr(), taps.data_ptr(), conv_state.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(), norm_w.data_ptr(), 1e-6,
            state.data_ptr(), out.data_ptr(), hk, hv, dk, dv, k, work.data_ptr(),
        )
        return [t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) for t in (silu, h_out, y, out, state, conv_state)]

    native, why = kernels._load("decode_bf16.c")
    narrow, narrow_why = kernels._load("decode_bf16.c", isa)
    assert native is not None and narrow is not None, why or narrow_why
    for name, got, want in zip(("silu_mul", "norm residual", "norm", "gdn output", "gdn state", "conv state"), run(narrow), run(native)):
        assert torch.equal(got, want), f"{isa}: {name} differs from the native build's"


def test_the_compiled_ops_refuse_bad_arguments():
    kernels.library()
    bf, f32 = torch.bfloat16, torch.float32
    h, scale = torch.randn(1, 64, dtype=bf), torch.ones(64)
    with pytest.raises(ValueError, match=r"add_rms_norm_bf16: scale must be float32, got bfloat16"):
        kernels.add_rms_norm(h, None, scale.to(bf), 1e-6)
    with pytest.raises(ValueError, match=r"add_rms_norm_bf16: x has shape \(1, 32\)"):
        kernels.add_rms_norm(h, torch.randn(1, 32, dtype=bf), scale, 1e-6)
    with pytest.raises(ValueError, match=r"add_rms_norm_bf16: h has shape \(2, 64\) \(128 elements\) where 64 are needed"):
        kernels.add_rms_norm(torch.randn(2, 64, dtype=bf), None, scale, 1e-6)
    with pytest.raises(ValueError, match=r"silu_mul_bf16: up has shape \(1, 63\)"):
        kernels.silu_mul(h, h[:, :63])
    # The GDN block: hk=1, hv=2, dk=dv=16, a 4-tap conv over 64 channels.
    hk, hv, dk, dv, k = 1, 2, 16, 16, 4
    conv = 2 * hk * dk + hv * dv
    args = dict(
        proj=torch.randn(1, conv + hv * dv + 2 * hv, dtype=bf), taps=torch.randn(k, conv), conv_state=torch.zeros(k - 1, conv, dtype=bf),
        neg_a=-torch.rand(hv), dt_bias=torch.zeros(hv, dtype=bf), norm_w=torch.ones(dv, dtype=bf), eps=1e-6,
        state=torch.zeros(hv, dk, dv), hk=hk, hv=hv, dk=dk, dv=dv,
    )
    assert kernels.gdn_decode(**args).shape == (1, hv * dv)
    with pytest.raises(ValueError, match=r"gdn_decode_bf16: state has shape \(2, 16, 8\)"):
        kernels.gdn_decode(**{**args, "state": torch.zeros(hv, dk, dv // 2)})
    with pytest.raises(ValueError, match=r"gdn_decode_bf16: conv_state must be contiguous"):
        kernels.gdn_decode(**{**args, "conv_state": torch.zeros(conv, k - 1, dtype=bf).t()})
    with pytest.raises(ValueError, match=r"gdn_decode_bf16: neg_a must be float32, got bfloat16"):
        kernels.gdn_decode(**{**args, "neg_a": args["neg_a"].to(bf)})
    # Gated attention: 2 heads over 1 KV head of 16, a cache of 8 positions, rotary over 8 dims.
    heads, kvh, d = 2, 1, 16
    att = dict(
        qkv=torch.randn(1, heads * 2 * d + 2 * kvh * d, dtype=bf), q_scale=torch.ones(d), k_scale=torch.ones(d), eps=1e-6,
        cos=torch.ones(4), sin=torch.zeros(4), k_pool=torch.zeros(3, kvh, 4, d, dtype=bf), v_pool=torch.zeros(3, kvh, 4, d, dtype=bf),
        table=torch.tensor([2, 0], dtype=torch.int32), pos=3, heads=heads, kv_heads=kvh, head_dim=d, scale=d**-0.5,
    )
    assert kernels.attention_decode(**att).shape == (1, heads * d)
    with pytest.raises(ValueError, match=r"attention_decode_bf16: pos 8 is outside the 2 blocks of 4 positions the table covers"):
        kernels.attention_decode(**{**att, "pos": 8})
    with pytest.raises(ValueError, match=r"attention_decode_bf16: v_pool has shape \(3, 1, 2, 16\)"):
        kernels.attention_decode(**{**att, "v_pool": torch.zeros(3, kvh, 2, d, dtype=bf)})
    with pytest.raises(ValueError, match=r"attention_decode_bf16: table holds block ids outside the pool's 3 blocks"):
        kernels.attention_decode(**{**att, "table": torch.tensor([3, 0], dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"attention_decode_bf16: table must be int32, got int64"):
        kernels.attention_decode(**{**att, "table": torch.tensor([2, 0])})
    with pytest.raises(ValueError, match=r"attention_decode_bf16: qkv has shape"):
        kernels.attention_decode(**{**att, "qkv": att["qkv"][:, :-1]})
    with pytest.raises(ValueError, match=r"attention_decode_bf16: k_pool must be bfloat16, got float32"):
        kernels.attention_decode(**{**att, "k_pool": torch.zeros(3, kvh, 4, d, dtype=f32)})
