"""Stand-ins, on CPU, for the device libraries the GDN adapters call: fla's two gated-delta-rule
functions and torch_npu's npu_chunk_gated_delta_rule. Each binds its arguments to the library's
signature (the installed one where fla is importable, else the one recorded here), checks what
the library documents about them, and computes its result with pocketllm's per-token reference,
so an adapter that calls the library wrongly fails a test before it ever meets a device.

Recorded signatures: fla-core 0.6.0, fla/ops/gated_delta_rule/chunk.py and fused_recurrent.py;
torch_npu's schema `npu::npu_chunk_gated_delta_rule(Tensor query, Tensor key, Tensor value, *,
Tensor? beta=None, Tensor? initial_state=None, Tensor? actual_seq_lengths=None, float? scale=None,
Tensor? g=None) -> (Tensor, Tensor)` (Ascend op-plugin, ChunkGatedDeltaRuleKernelNpuOpApi.cpp and
its graph converter), whose op allocates the output bf16 and returns a clone of initial_state.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types

import torch

from pocketllm.ops.gated_delta.naive import gated_delta_rule_reference

P = inspect.Parameter


def _signature(positional: str, keywords: dict, keyword_only: bool = False, var_keyword: bool = True) -> inspect.Signature:
    kind = P.KEYWORD_ONLY if keyword_only else P.POSITIONAL_OR_KEYWORD
    params = [P(n, P.POSITIONAL_OR_KEYWORD) for n in positional.split()]
    params += [P(n, kind, default=d) for n, d in keywords.items()]
    if var_keyword:
        params.append(P("kwargs", P.VAR_KEYWORD))
    return inspect.Signature(params)


FLA_VERSION = "0.6.0"
RECORDED_FLA = {
    "chunk_gated_delta_rule": _signature(
        "q k v g beta",
        dict(scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
             allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None),
    ),
    "fused_recurrent_gated_delta_rule": _signature(
        "q k v",
        dict(g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
             state_v_first=False, cu_seqlens=None),
    ),
}
NPU_SIGNATURE = _signature("query key value", dict(beta=None, initial_state=None, actual_seq_lengths=None, scale=None, g=None), keyword_only=True, var_keyword=False)


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def installed_fla_signatures() -> dict[str, inspect.Signature]:
    module = importlib.import_module("fla.ops.gated_delta_rule")
    return {name: inspect.signature(getattr(module, name)) for name in RECORDED_FLA}


def shape_of(sig: inspect.Signature) -> list[tuple]:
    """What a caller depends on: each parameter's name, kind and default, in order."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def _bind(sig: inspect.Signature, modelled: set[str], args, kwargs) -> dict:
    """Bind as the library would, then refuse anything set that the stand-in does not model:
    whatever it is, the adapter did not mean it."""
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    extra = a.pop("kwargs", {})
    if extra:
        raise TypeError(f"stand-in: unexpected keyword arguments {sorted(extra)}")
    for name, value in a.items():
        default = sig.parameters[name].default
        if name not in modelled and value is not default and not (isinstance(value, bool) and value == default):
            raise TypeError(f"stand-in: {name} was set ({type(value).__name__}), which the adapter never means to")
    return a


def _expect_shape(name: str, x: torch.Tensor, shape: tuple) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"stand-in: {name} must be {tuple(shape)}, got {tuple(x.shape)}")


class FlaStandIn:
    """fla.ops.gated_delta_rule's two functions, by the documented contract: q, k [B, T, H, K]; v
    [B, T, HV, V] with HV a multiple of H (GVA); g, beta [B, T, HV]; state [N, HV, K, V]; o = scale *
    q^T S; the output in q's dtype, the final state fp32."""

    MODELLED = {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state"}

    def __init__(self, signatures: dict[str, inspect.Signature]):
        self.signatures = signatures
        self.calls: list[tuple[str, dict]] = []

    def _run(self, name: str, args, kwargs, needs_g: bool):
        a = _bind(self.signatures[name], self.MODELLED, args, kwargs)
        self.calls.append((name, a))
        q, k, v = a["q"], a["k"], a["v"]
        B, T, H, K = q.shape
        _expect_shape("k", k, q.shape)
        HV, V = v.shape[2], v.shape[3]
        _expect_shape("v", v, (B, T, HV, V))
        if HV % H:
            raise ValueError(f"stand-in: HV={HV} is not a multiple of H={H}")
        if not q.dtype == k.dtype == v.dtype:
            raise TypeError(f"stand-in: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
        g, beta = a["g"], a["beta"]
        if g is None and needs_g:
            raise TypeError("stand-in: chunk_gated_delta_rule needs g")
        g = torch.zeros(B, T, HV) if g is None else g
        beta = torch.ones(B, T, HV) if beta is None else beta
        _expect_shape("g", g, (B, T, HV))
        _expect_shape("beta", beta, (B, T, HV))
        h0 = a["initial_state"]
        if h0 is not None:
            _expect_shape("initial_state", h0, (B, HV, K, V))
        scale = K**-0.5 if a["scale"] is None else a["scale"]
        outs, finals = [], []
        for b in range(B):
            out, final = gated_delta_rule_reference(
                q[b].float() * scale, k[b].float(), v[b], g[b].float(), beta[b].float(), None if h0 is None else h0[b].float()
            )
            outs.append(out)
            finals.append(final)
        return torch.stack(outs).to(q.dtype), torch.stack(finals) if a["output_final_state"] else None

    def chunk_gated_delta_rule(self, *args, **kwargs):
        return self._run("chunk_gated_delta_rule", args, kwargs, needs_g=True)

    def fused_recurrent_gated_delta_rule(self, *args, **kwargs):
        return self._run("fused_recurrent_gated_delta_rule", args, kwargs, needs_g=False)


class NpuStandIn:
    """torch_npu.npu_chunk_gated_delta_rule by its schema and the op-plugin's checks: beta,
    initial_state, actual_seq_lengths and scale required; bf16 query/key/value/beta, g fp32;
    state value-major [B, Nv, Dv, Dk], returned in the dtype it came in; output bf16. Whether an
    fp32 state is accepted is not documented, so it is a switch."""

    MODELLED = {"query", "key", "value", "beta", "initial_state", "actual_seq_lengths", "scale", "g"}

    def __init__(self, takes_fp32_state: bool):
        self.takes_fp32_state = takes_fp32_state
        self.calls: list[dict] = []

    def npu_chunk_gated_delta_rule(self, *args, **kwargs):
        a = _bind(NPU_SIGNATURE, self.MODELLED, args, kwargs)
        self.calls.append(a)
        for name in ("beta", "initial_state", "actual_seq_lengths", "scale"):
            if a[name] is None:
                raise RuntimeError(f"stand-in: {name} cannot be empty")
        q, k, v, beta, h0, lengths, g = (a[n] for n in ("query", "key", "value", "beta", "initial_state", "actual_seq_lengths", "g"))
        for name, x in (("query", q), ("key", k), ("value", v), ("beta", beta)):
            if x.dtype != torch.bfloat16:
                raise RuntimeError(f"stand-in: {name} must be bfloat16, got {x.dtype}")
        if h0.dtype not in ((torch.bfloat16, torch.float32) if self.takes_fp32_state else (torch.bfloat16,)):
            raise RuntimeError(f"stand-in: initial_state dtype {h0.dtype} is not supported")
        T, Nk, Dk = q.shape
        _expect_shape("key", k, q.shape)
        Nv, Dv = v.shape[1], v.shape[2]
        _expect_shape("value", v, (T, Nv, Dv))
        _expect_shape("beta", beta, (T, Nv))
        if g is not None:
            _expect_shape("g", g, (T, Nv))
            if g.dtype != torch.float32:
                raise RuntimeError(f"stand-in: g must be float32, got {g.dtype}")
        if lengths.dtype != torch.int32 or int(lengths.sum()) != T:
            raise RuntimeError(f"stand-in: actual_seq_lengths must be int32 summing to T={T}")
        _expect_shape("initial_state", h0, (len(lengths), Nv, Dv, Dk))
        g = torch.zeros(T, Nv) if g is None else g
        outs, finals, start = [], [], 0
        for b, n in enumerate(lengths.tolist()):
            s = slice(start, start + n)
            out, final = gated_delta_rule_reference(
                q[s].float() * a["scale"], k[s].float(), v[s].float(), g[s], beta[s].float(), h0[b].transpose(-1, -2).float()
            )
            outs.append(out)
            finals.append(final.transpose(-1, -2))
            start += n
        return torch.cat(outs).to(torch.bfloat16), torch.stack(finals).to(h0.dtype)


def install_fla(monkeypatch, stand_in: FlaStandIn) -> None:
    """Make `from fla.ops.gated_delta_rule import ...` find the stand-in (restored after the test)."""
    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = stand_in.chunk_gated_delta_rule
    module.fused_recurrent_gated_delta_rule = stand_in.fused_recurrent_gated_delta_rule
    for name, mod in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")), ("fla.ops.gated_delta_rule", module)):
        monkeypatch.setitem(sys.modules, name, mod)


def install_torch_npu(monkeypatch, stand_in: NpuStandIn) -> None:
    module = types.ModuleType("torch_npu")
    module.npu_chunk_gated_delta_rule = stand_in.npu_chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "torch_npu", module)
